"""Measure memory per device during a real training step, phase by phase, and record placement.

Every rank measures itself:
- the real tensor accounting: trainplan's storage tracker (a dispatch mode that sees every storage
  from the op that creates it until it is freed, resize-aware for FSDP) runs around one real step
  of the real run, with the step's phase marks (forward, backward, optimizer), so each phase's
  peak is kept apart and split by component: weights, buffers, gradients, optimizer, activations;
- on CUDA also the allocator: max_memory_allocated / max_memory_reserved, reset at every phase
  boundary, and NVML's used memory for the GPU (which also sees NCCL and the CUDA context);
- the process RSS.
Placement: which parameters (and top-level modules) live on which device, and their bytes there
(the local shard under FSDP).
"""

from __future__ import annotations

import resource

import torch
from torch import nn

from trainplan.run.dist import to_local


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of a tensor (its shard of a DTensor)."""
    local = to_local(t)
    return local.numel() * local.element_size()


def placement(model: nn.Module) -> dict:
    """Per device: parameter count, bytes held there, sharded count, and the top-level modules."""
    base = getattr(model, "module", model)
    out: dict[str, dict] = {}
    for name, p in base.named_parameters():
        local = to_local(p)
        dev = str(local.device)
        entry = out.setdefault(dev, {"parameters": 0, "bytes": 0, "sharded": 0, "modules": []})
        entry["parameters"] += 1
        entry["bytes"] += local_nbytes(p)
        entry["sharded"] += int(hasattr(p, "to_local"))
        top = ".".join(n for n in name.split(".")[:-1] if not n.isdigit())[:80] or name
        if top not in entry["modules"] and len(entry["modules"]) < 64:
            entry["modules"].append(top)
    for entry in out.values():
        entry["buffers_bytes"] = 0
    for b in base.buffers():
        out.setdefault(str(b.device), {"parameters": 0, "bytes": 0, "sharded": 0, "modules": [], "buffers_bytes": 0})
        out[str(b.device)]["buffers_bytes"] += local_nbytes(b)
    return out


def _nvml_used(device: torch.device) -> int | None:
    try:
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # no NVML (pynvml) on this machine
        return None


class StepMeter:
    """Wraps one real training step: `with meter: train_step(..., on_phase=meter.on_phase)`."""

    def __init__(self, model: nn.Module, optimizer, inputs, device: torch.device, *, lora: bool, comm=()) -> None:
        from trainplan import _torch_private as P

        self.model, self.optimizer, self.device, self.lora = model, optimizer, device, lora
        # on a GPU, its own storages only: host memory (offloaded states and activations) is the host's
        self.tracker = P.StorageTracker(device=device if device.type == "cuda" else None)
        self.tracker.track(getattr(model, "module", model), optimizer, inputs, comm)
        self.raw: dict[str, dict[str, int]] = {}
        self.order: list[str] = []
        self.cuda: dict[str, dict[str, int | None]] = {}
        self._current: str | None = None

    def __enter__(self) -> StepMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.__exit__(*exc)

    def on_phase(self, name: str) -> None:
        if self._current is not None:
            self.raw[self._current] = self.tracker.peak_by_category()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self.cuda[self._current] = {
                    "max_allocated": torch.cuda.max_memory_allocated(self.device),
                    "max_reserved": torch.cuda.max_memory_reserved(self.device),
                    "nvml_used": _nvml_used(self.device),
                }
                torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker.reset_peak()
        self._current = None if name == "end" else name
        self.tracker.phase = self._current or ""
        if self._current and self._current not in self.order:
            self.order.append(self._current)

    def _reclassified(self) -> dict[str, dict[str, int]]:
        """Per-phase peaks with late-recognised gradients moved to their category. DDP rebuilds its
        gradient buckets at the start of the second step's forward: the tracker sees a new storage
        (an activation) that only becomes known as the gradients' home when the optimizer reads
        p.grad. For every phase from its birth up to the one that recognised it, it was a gradient."""
        raw = {ph: dict(v) for ph, v in self.raw.items()}
        index = {ph: i for i, ph in enumerate(self.order)}
        for nbytes, born, seen, old, new in self.tracker.retagged:
            if old != "activations" or new != "grads" or born not in index or seen not in index:
                continue
            for ph in self.order[index[born] : index[seen]]:
                moved = min(nbytes, raw[ph].get("activations", 0))
                raw[ph]["activations"] = raw[ph].get("activations", 0) - moved
                raw[ph]["grads"] = raw[ph].get("grads", 0) + moved
        return raw

    def result(self) -> dict:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        adapter = sum(local_nbytes(p) for p in trainable) if self.lora else 0
        inner = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: this rank's shard
        opt_state = [s for s in inner.state.values() if isinstance(s, dict)] if inner is not None else []
        states = sum(local_nbytes(v) for s in opt_state for v in s.values() if isinstance(v, torch.Tensor))
        phases = {
            ph: to_components(raw, adapter_params=adapter, states=states, lora=self.lora, phase=ph)
            for ph, raw in self._reclassified().items()
        }
        return {
            "device": str(self.device),
            "phases": phases,
            "raw": self.raw,
            "cuda": self.cuda,
            "peak_bytes": max((sum(c.values()) for c in phases.values()), default=0),
            "max_rss_bytes": max_rss_bytes(),
            "placement": placement(self.model),
        }


class CompiledStepMeter:
    """Wraps one compiled training step (train.compile), as StepMeter does an eager one. The storage
    tracker is a dispatch mode, under which torch.compile runs its frames eagerly: it would measure
    another step. So the compiled step is measured from the outside, per phase, as totals: on CUDA the
    allocator's max_memory_allocated; on the CPU torch.profiler's allocator events (inductor's buffers
    bypass the dispatcher, not the allocator), from what is live as the step starts (parameters,
    buffers, gradients, optimizer state, the batch). comm: StepMeter's, always empty here (train.compile
    is refused beside pipeline stages, the only holders of such buffers)."""

    def __init__(self, model: nn.Module, optimizer, inputs, device: torch.device, *, lora: bool, comm=()) -> None:
        from trainplan import _torch_private as P

        self.model, self.device = model, device
        self.cuda: dict[str, dict[str, int | None]] = {}
        self.order: list[str] = []
        self._range = None
        self._prof = None
        self.base = 0
        if device.type != "cuda":
            held = [*model.parameters(), *model.buffers(), *inputs]
            held += [p.grad for p in model.parameters() if p.grad is not None]
            inner = getattr(optimizer, "optim", optimizer)
            for state in inner.state.values() if inner is not None else ():
                held += [v for v in state.values() if isinstance(v, torch.Tensor)] if isinstance(state, dict) else []
            storages = {}
            for t in held:
                local = to_local(t)
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            # DDP's gradient buckets live in its C++ reducer: allocated before the step, held through it
            self.base = sum(storages.values()) + P.ddp_bucket_bytes(model)

    def __enter__(self) -> CompiledStepMeter:
        from torch.profiler import ProfilerActivity, profile

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._prof.__exit__(*exc)

    def on_phase(self, name: str) -> None:
        from torch.profiler import record_function

        if self.order and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda[self.order[-1]] = {
                "max_allocated": torch.cuda.max_memory_allocated(self.device),
                "max_reserved": torch.cuda.max_memory_reserved(self.device),
                "nvml_used": _nvml_used(self.device),
            }
            torch.cuda.reset_peak_memory_stats(self.device)
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if name != "end":
            self.order.append(name)
            if self._prof is not None:
                self._range = record_function(f"PHASE_{name}")
                self._range.__enter__()

    def result(self) -> dict:
        if self.device.type == "cuda":
            phases = {ph: {"total": c["max_allocated"]} for ph, c in self.cuda.items()}
        else:
            from trainplan import _torch_private as P

            events, spans = P.memory_timeline(self._prof)
            phases, live, i = {}, self.base, 0
            for ph in self.order:
                start, end = spans[ph]
                while i < len(events) and events[i][0] < start:
                    live += events[i][1]
                    i += 1
                peak = live
                while i < len(events) and events[i][0] <= end:
                    live += events[i][1]
                    peak = max(peak, live)
                    i += 1
                phases[ph] = {"total": peak}
        return {
            "device": str(self.device),
            "phases": phases,
            "raw": {},
            "cuda": self.cuda,
            "peak_bytes": max((c["total"] for c in phases.values()), default=0),
            "max_rss_bytes": max_rss_bytes(),
            "placement": placement(self.model),
            "method": "compiled step: "
            + ("CUDA allocator" if self.device.type == "cuda" else "profiler allocator events"),
        }


def step_meter(compiled: bool):
    """The meter for a run's measured step: StepMeter, or CompiledStepMeter under train.compile."""
    return CompiledStepMeter if compiled else StepMeter


class PhaseMeter:
    """The peak bytes a device holds during one phase of the run around the step (load, evaluate,
    save): `with PhaseMeter(device, model, optimizer) as m: ...; m.peak_bytes`.

    Absolute, like the plan's phase totals: on CUDA the allocator's max_memory_allocated (reset on
    entry); elsewhere the storage tracker, with the model's parameters, buffers, gradients and the
    optimizer's state registered first, and DDP's gradient buckets added. What is not a torch
    storage (safetensors' serialized bytes, Python objects) is in neither. comm: buffers held beside
    the model (a pipeline stage's receive buffers)."""

    def __init__(self, device: torch.device, model: nn.Module | None = None, optimizer=None, comm=()) -> None:
        from trainplan import _torch_private as P

        self.device = device
        self.peak_bytes: int | None = None
        self.tracker = None
        self.outside = 0  # held throughout, where the tracker cannot see it: DDP's gradient buckets
        if device.type != "cuda":
            self.tracker = P.StorageTracker()
            if model is not None:
                self.tracker.track(getattr(model, "module", model), optimizer, comm=comm)
                self.outside = P.ddp_bucket_bytes(model)

    def __enter__(self) -> PhaseMeter:
        if self.tracker is not None:
            self.tracker.__enter__()
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)
            self.peak_bytes = self.tracker.peak_total + self.outside
            self.tracker = None  # its finalizers must not outlive the phase's objects
        else:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)


def to_components(raw: dict[str, int], *, adapter_params: int, states: int, lora: bool, phase: str) -> dict[str, int]:
    """Tracker categories -> ledger components. LoRA's params/grads/states are exactly known, so
    they move to the adapter row; in the optimizer phase, what exceeds the states is temporary.
    FSDP's all-gathered parameters and reduce-scatter buffers count as activations here."""
    out = {
        "weights": raw.get("params", 0),
        "buffers": raw.get("buffers", 0),
        "gradients": raw.get("grads", 0),
        "optimizer": raw.get("optimizer", 0),
        "activations": raw.get("activations", 0) + raw.get("inputs", 0),
    }
    if raw.get("comm"):  # a pipeline stage's receive buffers, held from its first step on
        out["comm_buffers"] = raw["comm"]
    if phase == "optimizer":
        out["optimizer_temp"] = max(0, out["optimizer"] - states)
        out["optimizer"] -= out["optimizer_temp"]
    if lora:
        out["weights"] -= adapter_params
        out["adapter"] = adapter_params + out.pop("gradients") + out.pop("optimizer")
    return out


def max_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
