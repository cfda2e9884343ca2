"""Every use of private PyTorch APIs lives here: fake tensors and torch.distributed._tools.

Tested on torch 2.13 (tests/test_torch_private.py). An upgrade outside TESTED_TORCH fails here,
loudly, instead of somewhere deep in a trace.

Workarounds for torch 2.13, each needed by the tracer:
- `.to()` / `to_empty()` fail on modules holding fake parameters: build on meta, wrap with PEFT
  first, then `to_empty` inside `FakeTensorMode(allow_non_fake_inputs=True)`.
- MemTracker registers grad hooks on every parameter and fails on frozen ones: skip those.
- MemTracker refuses a second iteration unless module stats are reset: reset per iteration.
- The peak is global to the tracker: reset it at phase boundaries to get per-phase peaks.
- Fake CUDA tensors abort on a CPU build: trace on the CPU device only.
- Under inference_mode, composite ops reach a dispatch mode undecomposed, hiding their inner
  allocations from the tracker: decompose them inside the tracker.

And one for transformers (5.x): its mask code cannot read fake position ids, so under fake tensors
it assumes packed sequences and materializes a (b, 1, s, s) mask plus repeat_kv copies that a real
run without padding never allocates. trainplan's batches are unpacked, so the trace tells it so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainplan.errors import TrainplanError

TESTED_TORCH = ((2, 8), (2, 14))  # [low, high] major.minor, inclusive


def check_torch_version(version: str = torch.__version__) -> None:
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    low, high = TESTED_TORCH
    if not low <= (major, minor) <= high:
        raise TrainplanError(
            f"torch {version} is outside the range trainplan's tracer is tested with "
            f"({low[0]}.{low[1]}-{high[0]}.{high[1]}); install torch==2.13.0 (requirements.txt)"
        )


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Tell transformers' mask code the batch holds one sequence per row, as trainplan's batches do."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # older transformers: no packed-sequence detection to bypass
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def fake_mode():
    """A FakeTensorMode in which real (meta-built) modules can be materialized as fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# Categories of the trackers, mapped to trainplan's names.
CATEGORY = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "inputs",
    "Inputs": "inputs",
    "Unsharded Param": "unsharded_params",
    "Unsharded Grad": "unsharded_grads",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
}


def _decomposable(func) -> bool:
    try:
        return func._can_decompose()
    except RuntimeError:  # an op without a registered schema for the query
        return False


def _phase_tracker_class(base: type) -> type:
    class PhaseTracker(base):
        """A tracker whose peak can be reset between phases, and that tolerates frozen params."""

        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            if not install_grad_hooks:
                return super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            params = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            for p in module.parameters():
                if p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:

                    def hook(grad, self=self):
                        from torch.distributed._tools.mem_tracker import _MemRefType

                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(hook),
                        p.register_post_accumulate_grad_hook(lambda q, hook=hook: hook(q.grad)),
                    )
            return params

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # Under inference_mode, composite ops (cross_entropy, linear) reach the mode whole and
            # their inner allocations (cross_entropy's log-softmax) would be invisible: decompose
            # them with the tracker re-entered so every allocation is seen.
            if torch.is_inference_mode_enabled() and getattr(func, "namespace", "") == "aten" and _decomposable(func):
                with self:
                    out = func.decompose(*args, **(kwargs or {}))
                if out is not NotImplemented:
                    return out
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            # Only the device-wide peak is needed; the per-module bookkeeping the base class does
            # on every op costs O(modules) and dominates trace time on deep models.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def reset_peak(self) -> None:
            self._peak_mem = {}
            self._peak_mem_snap = {}

        def peak_by_category(self) -> dict[str, int]:
            """Bytes per trainplan category at the peak since the last reset (all devices summed)."""
            out: dict[str, int] = {}
            for snap in self.get_tracker_snapshot("peak").values():
                for key, val in snap.items():
                    if key == "Total":
                        continue
                    name = CATEGORY.get(getattr(key, "value", key), str(key))
                    out[name] = out.get(name, 0) + val
            return out

    return PhaseTracker


def mem_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    return _phase_tracker_class(MemTracker)()


def fsdp_mem_tracker(model: nn.Module, optimizer: torch.optim.Optimizer):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    cls = _phase_tracker_class(FSDPMemTracker)
    return cls(model, optimizer)


def new_iteration(tracker) -> None:
    """MemTracker refuses a module's second forward unless its module stats are cleared."""
    tracker.reset_mod_stats()


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A single-process fake process group of `world_size` ranks (no communication happens)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TrainplanError("trace: a process group is already initialized; run the trace in its own process")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
