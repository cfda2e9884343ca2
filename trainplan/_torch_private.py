"""Every use of private PyTorch and transformers internals lives here: fake tensors, the fake process group,
dispatch-mode tracking, packed DTensor splits, and transformers' mask code.

The torch range trainplan is tested with is TESTED_TORCH below, the one statement of it: pyproject's `run` extra
declares the same bounds and requirements.txt pins a version inside them (tests/test_torch_private.py holds all three
together). An upgrade outside it fails here, loudly, instead of somewhere deep in a trace.

Known workarounds, each needed by the tracer:
- `.to()` / `to_empty()` fail on modules holding fake parameters: build on meta, wrap with PEFT first, then
  `to_empty` inside `FakeTensorMode(allow_non_fake_inputs=True)`; to_empty unties weights: the builder re-ties.
- torch.distributed._tools.MemTracker fails on frozen parameters, refuses a second iteration,
  spends O(modules) per op, and (torch 2.13) keeps counting some storages after they are freed
  when LoRA meets activation checkpointing (+T x V bytes after the loss). StorageTracker below
  counts storages from creation to release instead; tests check it against the profiler.
- Under inference_mode, composite ops reach a dispatch mode undecomposed, hiding their inner
  allocations (cross_entropy's log-softmax): the tracker decomposes them.
- FSDP2 frees unsharded parameters with UntypedStorage.resize_(0), which no dispatch mode sees:
  the tracker wraps resize_ while it is active.
- bitsandbytes' 8-bit optimizer update is one custom op, whose CPU kernel (Python) allocates its
  fp32 temporaries below the dispatcher: the tracker runs that kernel's body under itself, so a CPU
  run's optimizer phase holds what the plan says (`_python_body`).
- A dispatch mode makes torch.compile run its frames eagerly: a compiled step is measured from the
  outside, through the profiler's allocator events (`memory_timeline`) or CUDA's allocator.
- Fake CUDA tensors abort on a CPU build: trace on the CPU device only.
- transformers 5's mask code cannot read fake position ids, so under fake tensors it assumes packed
  sequences (a (b, 1, s, s) mask); the trace tells it where the documents are.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from trainplan.errors import TrainplanError

TESTED_TORCH = ((2, 8), (2, 14))  # [low, high] major.minor, inclusive
CATEGORIES = ("params", "buffers", "grads", "optimizer", "inputs", "comm", "activations")


def check_torch_version(version: str = torch.__version__) -> None:
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    low, high = TESTED_TORCH
    if not low <= (major, minor) <= high:
        raise TrainplanError(
            f"torch {version} is outside the range trainplan's tracer is tested with "
            f"({low[0]}.{low[1]}-{high[0]}.{high[1]}); install torch==2.13.0 (requirements.txt)"
        )


@contextlib.contextmanager
def _packed_sequence_indices(find) -> Iterator[None]:
    """transformers' mask code told where a batch's packed documents are by `find`, not by their values."""
    import transformers.masking_utils as masking

    original, masking.find_packed_sequence_indices = masking.find_packed_sequence_indices, find
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def unpacked_sequences():
    """Tell transformers' mask code the batch holds one sequence per row, as trainplan's batches do."""
    return _packed_sequence_indices(lambda position_ids: None)


def packed_sequences():
    """Tell transformers' mask code the batch holds packed documents, without reading the position ids'
    values (fake tensors have none): the document index of each token, from where its position is 0."""
    return _packed_sequence_indices(lambda position_ids: (position_ids == 0).cumsum(-1) - 1)


def fake_mode():
    """A FakeTensorMode in which real (meta-built) modules can be materialized as fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def grouped_mm_any_dtype() -> Iterator[None]:
    """Fake tensors through aten._grouped_mm (transformers' MoE experts) in fp32 and fp16: torch's meta kernel
    checks for bf16 only (the CUDA fast path's constraint), while the CPU and CUDA kernels also take fp32 and
    fp16 and return the input dtype (without this, tracing an fp32 MoE model raises where training does not)."""
    import torch._meta_registrations as M

    original = M._meta_grouped_mm_common

    def common(mat_a, mat_b, scale_a=None, scale_b=None, offs=None, bias=None, scale_result=None, out_dtype=None, **kw):
        if scale_a is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.float32, torch.float16):
            return M._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, **kw)

    M._meta_grouped_mm_common = common
    try:
        yield
    finally:
        M._meta_grouped_mm_common = original


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Trace on the CPU with what CUDA's kernels save, for a plan that targets GPUs.

    - dropout: CUDA runs the fused native_dropout, which saves a bool mask; the CPU path saves
      `input * noise`'s noise in the input's dtype.
    - scaled_dot_product_attention: CUDA runs flash attention (fp16/bf16, no mask) or memory-
      efficient attention (otherwise), both with fused dropout; the CPU falls back to the math
      kernel when dropout is on, saving the s^2 attention weights. The CUDA ops' meta kernels
      give the exact saved tensors on fake CPU tensors.
    """
    import torch.nn.functional as F

    dropout_orig, sdpa_orig = F.dropout, F.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        return torch.native_dropout(input, p, True)[0]

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):  # autocast lowers SDPA's inputs; it does not know these ops
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        same = query.shape[-1] == key.shape[-1] == value.shape[-1]  # flash: one width (not MLA's narrower values)
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256 and same:
            return torch.ops.aten._scaled_dot_product_flash_attention(  # handles GQA natively
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if (groups := query.shape[-3] // key.shape[-3]) != 1:  # efficient attention wants equal head counts
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]

    F.dropout, F.scaled_dot_product_attention = dropout, sdpa
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout_orig, sdpa_orig


def _python_body(func, args, kwargs) -> Callable | None:
    """The Python kernel behind a custom op on CPU tensors whose inner allocations the tracker must
    see (bitsandbytes' 8-bit optimizer update, private to bitsandbytes); None for any other op."""
    if getattr(func, "namespace", "") != "bitsandbytes" or "optimizer_update_8bit_blockwise" not in str(func):
        return None
    if not any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in (*args, *kwargs.values())):
        return None
    from bitsandbytes.backends.cpu import ops

    return ops._optimizer_update_8bit_blockwise_cpu


# autograd nodes that make a view or a copy of their one input: a tensor whose history reaches a
# parameter through these alone is that parameter's (a transposed weight, autocast's bf16 copy)
_VIEW_OR_CAST = frozenset(
    "TBackward0 ToCopyBackward0 ViewBackward0 TransposeBackward0 PermuteBackward0 ExpandBackward0 AliasBackward0 "
    "UnsafeViewBackward0".split()
)


def derives_from_parameter(t: torch.Tensor) -> bool:
    """Whether `t` is a view or a cast of a parameter that requires grad: its autograd history reaches
    the parameter's AccumulateGrad through view and copy nodes alone (autograd node class names)."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_OR_CAST:
        parents = [f for f, _ in fn.next_functions if f is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(fn.variable, torch.nn.Parameter)
    return False


def is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (the traced plan's): it has no memory, and its data_ptr() is 0."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(t)


def memory_timeline(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """From a finished `torch.profiler.profile(profile_memory=True)`: the CPU allocator's events as
    (time ns, +bytes allocated / -bytes freed), in order, and the spans of the `record_function`
    ranges named "PHASE_<name>" as {name: (start ns, end ns)}. Every allocation is there, inductor's
    buffers included (they bypass the dispatcher, not the allocator)."""
    events, spans = [], {}
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            if e.device_type() == torch.autograd.DeviceType.CPU:
                events.append((e.start_ns(), e.nbytes()))
        elif e.name().startswith("PHASE_"):
            spans[e.name()[6:]] = (e.start_ns(), e.start_ns() + e.duration_ns())
    events.sort()
    return events, spans


def _decomposable(func) -> bool:
    try:
        return getattr(func, "namespace", "") == "aten" and func._can_decompose()
    except RuntimeError:  # an op without a registered schema for the query
        return False


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of DDP's gradient buckets (gradient_as_bucket_view): allocated in the C++ reducer,
    they hold the gradients between steps while every p.grad is None, so no dispatch mode sees
    them. Read from DDP's logging data; 0 for any other module."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(x) for x in sizes.split(",") if x.strip())


def local_slice(dtensor) -> tuple[slice, ...] | None:
    """The box of the global tensor this rank's shard of `dtensor` holds (FSDP2, tp), for a loader to
    copy just those bytes from a memory-mapped file; None where torch maps the placements to none."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as box

    if packed(dtensor):  # torch maps its strided local to one wrong box
        return None
    try:
        shape, offset = box(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    except (NotImplementedError, AssertionError, RuntimeError):
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def packed_shard(dim: int, parts: int):
    """A split of a dim of `parts` equal parts (a fused [gate; up]), each over the mesh: rank r holds [part 0's
    r-th chunk; part 1's; ...]. torch's _StridedShard: full_tensor and distribute_tensor know it, DCP not."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=parts)


def packed(dtensor) -> tuple[int, int] | None:
    """(dim, parts) of a DTensor split by packed_shard over a 1-D mesh, else None."""
    from torch.distributed.tensor.placement_types import _StridedShard

    p, *more = getattr(dtensor, "placements", (None,))
    return (p.dim, p.split_factor) if isinstance(p, _StridedShard) and not more else None


def fsdp_offload_policy(model: torch.nn.Module) -> str | None:
    """The offload policy FSDP2 applied ("CPUOffloadPolicy", or "OffloadPolicy": none), read from its
    first unit that holds parameters; None when the model is not sharded by FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if groups:
                return type(groups[0].offload_policy).__name__
    return None


def fsdp_reshards_after_forward(model: torch.nn.Module) -> bool | None:
    """Whether FSDP2 frees the unsharded parameters after each unit's forward (ZeRO-3) or keeps them until backward
    (fsdp-grad-op), from its parameter groups; None if not FSDP2. The root is left out: it may keep them either way."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    if not units and not isinstance(model, FSDPModule):
        return None
    groups = [g for m in units or [model] for g in m._get_fsdp_state()._fsdp_param_groups]
    return any(g._reshard_after_forward for g in groups)


@contextlib.contextmanager
def no_gguf_bars() -> Iterator[None]:
    """No progress bar while transformers loads a GGUF file, for output that is piped: its weight loading
    bar (transformers' logging tqdm) and the GGUF loader's own, a tqdm that disable_progress_bar misses."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, enabled = gguf_utils.tqdm, transformers.utils.logging.is_progress_bar_enabled()
    gguf_utils.tqdm = functools.partial(original, disable=True)
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        if enabled:
            transformers.utils.logging.enable_progress_bar()


def set_expandable_segments(on: bool) -> None:
    """Switch the CUDA caching allocator's expandable segments within a process (bench/gpu_validate.py
    runs both modes in one), as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True|False does at start.
    Takes effect for segments created from here on: empty the cache first."""
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{on}")


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Ops run here are invisible to the storage tracker (and every other dispatch mode): for views
    of memory torch did not allocate, such as a memory-mapped weights file."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _on_free(storage, tracker: StorageTracker, key: int) -> None:
    """Call tracker._free(key) when `storage` dies. The finalizer registry is global and lives as
    long as the storage: it must hold the tracker only weakly, or the tracker's parameter list keeps
    the whole model (and the storage itself) alive after the measured step."""
    ref = weakref.ref(tracker)

    def free() -> None:
        t = ref()
        if t is not None:
            t._free(key)

    weakref.finalize(storage, free)


class StorageTracker(TorchDispatchMode):
    """Counts every tensor storage from the op that creates it until it is freed.

    Categories: params, buffers, grads (re-tagged when a gradient is accumulated or the optimizer
    steps), optimizer (states, and anything allocated inside optimizer.step()), inputs, and
    activations (everything else: saved tensors, temporaries, logits). The peak since the last
    `reset_peak` is kept per category, so phases can be measured one by one.
    """

    def __init__(self, fake=None, device: torch.device | None = None) -> None:
        """fake: the FakeTensorMode whose tensors stand for memory (the traced plan); any other
        tensor without real storage is not counted. device: count only storages of this device type
        (a GPU's meter: host memory, where offload puts its tensors, is not the GPU's)."""
        super().__init__()
        self.fake = fake
        self.device_type = device.type if device is not None else None
        self._live: dict[int, list] = {}  # id(storage) -> [category, nbytes]
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak_total = 0
        self.peak = dict(self.totals)
        self._in_optimizer = False
        self._handles: list = []
        self._params: list[torch.nn.Parameter] = []
        self.phase = ""  # set by the caller at phase boundaries; stamped on each new storage
        self.retagged: list[tuple[int, str, str, str, str]] = []  # (nbytes, born in, retagged in, from, to)
        # Set to a list to record the allocation stream in order, for plan/allocator.py to replay:
        # ("alloc", key, nbytes), ("free", key), and the caller's ("phase", name) marks.
        self.events: list[tuple] | None = None
        self._event_keys: dict[int, int] = {}  # id(storage) -> its key in `events` (ids are reused)
        self._serial = itertools.count()
        # Autograd sums a tied parameter's two gradients into the first one's buffer when no dispatch
        # mode is active, and into a third tensor while one is (this mode included). True: do the sum
        # in place as an unmeasured run does, so the tracker does not perturb what it measures.
        self.sum_tied_in_place = True
        self._tied: set[tuple[tuple[int, ...], torch.dtype]] = set()  # (shape, dtype) of tied parameters

    # -- bookkeeping ----------------------------------------------------------------------
    def _add(self, t: torch.Tensor, category: str) -> None:
        local = t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor reports its mesh's device
        ours = self.fake is not None and getattr(local, "fake_mode", None) is self.fake
        st = local.untyped_storage()
        if st.device.type == "meta" and not ours:
            # no memory: a model built on meta, or the fake tensors DTensor's sharding propagation
            # makes for itself (they report the fake device). Only the traced plan's own fake
            # tensors (self.fake) stand for memory.
            return
        if self.device_type is not None and st.device.type != self.device_type and not ours:
            return
        key = id(st)
        entry = self._live.get(key)
        if entry is not None:
            # an optimizer updating a parameter (or its gradient) in place does not make it a state
            kept = category == "optimizer" and entry[0] in ("params", "buffers", "grads")
            if category in ("params", "grads", "optimizer", "buffers", "inputs") and entry[0] != category and not kept:
                self.retagged.append((entry[1], entry[2], self.phase, entry[0], category))
                self.totals[entry[0]] -= entry[1]
                self.totals[category] += entry[1]
                entry[0] = category
            return
        nbytes = st.nbytes()
        self._live[key] = [category, nbytes, self.phase]
        self._record(key, nbytes)
        self.totals[category] += nbytes
        self.total += nbytes
        _on_free(st, self, key)
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.peak = dict(self.totals)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.totals[entry[0]] -= entry[1]
            self.total -= entry[1]
            self._record(key, 0)

    def _record(self, key: int, nbytes: int) -> None:
        """The storage `key` now holds nbytes (0: freed). A resize is a new block, then the old one
        freed, as the caching allocator serves it."""
        if self.events is None:
            return
        old = self._event_keys.pop(key, None)
        if nbytes:
            self._event_keys[key] = new = next(self._serial)
            self.events.append(("alloc", new, nbytes))
        if old is not None:
            self.events.append(("free", old))

    def track(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, inputs=(), comm=()) -> None:
        """Register what exists before the step: parameters, buffers, kept gradients (DDP's buckets),
        optimizer state, the batch, comm buffers (a pipeline stage's receive buffers)."""
        self._params = [p for p in model.parameters()]
        seen: set[int] = set()
        for _, p in model.named_parameters(remove_duplicate=False):  # a tied parameter comes twice
            if id(p) in seen and p.requires_grad:
                self._tied.add((tuple(p.shape), p.dtype))
            seen.add(id(p))
        for p in self._params:
            self._add(p, "params")
            if p.grad is not None:
                self._add(p.grad, "grads")
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for b in model.buffers():
            self._add(b, "buffers")
        for category, tensors in (("inputs", inputs), ("comm", comm)):
            for t in tensors:
                self._add(t, category)
        if optimizer is not None:
            self._tag_optimizer(optimizer)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None:
            self._add(p.grad, "grads")

    def _tag_optimizer(self, optimizer) -> None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's shard
        for state in inner.state.values():
            for v in state.values() if isinstance(state, dict) else ():
                if isinstance(v, torch.Tensor):
                    self._add(v, "optimizer")

    def reset_peak(self) -> None:
        self.peak_total = self.total
        self.peak = dict(self.totals)

    def peak_by_category(self) -> dict[str, int]:
        return dict(self.peak)

    # -- dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # let DTensor desugar into local ops, which come back here
        if torch.is_inference_mode_enabled() and _decomposable(func):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        body = _python_body(func, args, kwargs)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        if self._tied and func is torch.ops.aten.add.Tensor and self._tied_gradient_sum(args, kwargs):
            summed = args[0].add_(args[1])
            entry = self._live.get(id(summed.untyped_storage()))
            if entry is not None:  # a gradient from now on (the fused loss made the head's in forward)
                entry[2] = self.phase
            return summed
        out = func(*args, **kwargs)
        category = "optimizer" if self._in_optimizer else "activations"
        tree_map_only(torch.Tensor, lambda t: self._add(t, category), out)
        return out

    def _tied_gradient_sum(self, args, kwargs) -> bool:
        """Is this add autograd's sum of a tied parameter's two gradients (engine.cpp's InputBuffer
        accumulate: `old_var + var` when a Python mode makes every tensor subclass-like; without one,
        `old_var.add_(var)` when the engine holds old_var's only reference, as with the head's gradient
        that the fused loss returns)? In backward, two same-shape dense tensors of a tied parameter's
        shape and dtype, no alpha."""
        if not self.sum_tied_in_place or kwargs or len(args) != 2 or torch._C._current_graph_task_id() == -1:
            return False
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or torch.is_grad_enabled():
            return False
        same = a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        return same and (tuple(a.shape), a.dtype) in self._tied and a.is_contiguous() and not a.requires_grad

    def __enter__(self):
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth > 1:  # re-entered to decompose an op: hooks and patches are already in place
            return super().__enter__()
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(optimizer, args, kwargs):
            for p in self._params:  # FSDP assigns sharded grads without accumulate-grad hooks
                if p.grad is not None:
                    self._add(p.grad, "grads")
            self._in_optimizer = True

        def post(optimizer, args, kwargs):
            self._in_optimizer = False
            self._tag_optimizer(optimizer)

        self._handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        # FSDP2 frees and re-allocates unsharded parameters by resizing their storage in place,
        # which no dispatch mode sees: follow UntypedStorage.resize_ directly.
        original = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            out = original(st, size)
            entry = tracker._live.get(id(st))
            if entry is None and size > 0:
                tracker._live[id(st)] = entry = ["activations", 0, tracker.phase]
                _on_free(st, tracker, id(st))
            if entry is not None and entry[1] != st.nbytes():
                tracker._record(id(st), st.nbytes())
                delta = st.nbytes() - entry[1]
                entry[1] += delta
                tracker.totals[entry[0]] += delta
                tracker.total += delta
                if tracker.total > tracker.peak_total:
                    tracker.peak_total = tracker.total
                    tracker.peak = dict(tracker.totals)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth > 0:
            return super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A single-process fake process group of `world_size` ranks (no communication happens)."""
    import torch.distributed as dist
    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake-mode kernels for collectives)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TrainplanError("trace: a process group is already initialized; run the trace in its own process")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def static_pipeline(schedule) -> None:
    """`schedule`'s stages in torch's static metadata mode (built with their input/output args and gradients),
    without the ranks' warm-up vote on it: a stage whose peers are faked (the trace) receives nothing real."""
    from torch.distributed.pipelining.stage import InferenceMode

    schedule._warmup_p2p = lambda stages, *_: [setattr(s, "_inference_mode", InferenceMode.STATIC) for s in stages]


def partitioned_backend():
    """A torch.compile backend that decides what a compiled region saves as inductor does (its
    decompositions, its joint-graph passes and min-cut partitioner) and then runs the partitioned
    forward and backward graphs op by op, uncompiled: inductor's saved set, on any tensors (fake
    ones included), without generating code. torch's `aot_eager_decomp_partition` debugging backend,
    plus the joint-graph passes that inductor's `partition_fn` runs before the min cut."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import get_nop_func
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    def partition(gm, joint_inputs, **kwargs):
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # the joint passes expect inductor's context
            return compile_fx.partition_fn(gm, joint_inputs, **kwargs)

    nop, decompositions = get_nop_func(), compile_fx.select_decomp_table
    return aot_autograd(fw_compiler=nop, bw_compiler=nop, decompositions=decompositions, partition_fn=partition)


def forget_compiled() -> None:
    """Drop every torch.compile cache entry of this process (a compiled function compiles again)."""
    import torch._dynamo

    torch._dynamo.reset()
