"""The per-rank bill that a run's preflight checks (run/preflight.py), taken from the analytic plan of
the config the run resolved. The engine cannot import the planner, so `trainplan train` hands this in."""

from __future__ import annotations

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.plan.analytic import plan
from trainplan.plan.ledger import DeviceLedger
from trainplan.resolve import resolve
from trainplan.run.preflight import Bill
from trainplan.spec.devices import MiB, format_gib


def preflight_bill(cfg: C.RunConfig) -> Bill:
    """What each rank needs free when the preflight runs (after data load, before the model is built).

    Device, per rank: the plan's need (peak allocated + runtime) and hardware.safety_margin of the
    device, less the runtime that is already resident when the check measures (the CUDA context,
    hardware.cuda_context_mib; on the CPU, hardware.cpu_runtime_mib); and apart, the verdict's margin
    (accuracy band + allocator reserve). Short of the need the run stops (the plan said DOES NOT FIT);
    short of the margin only, it warns (TIGHT), as the plan did.

    Host, per rank (a node's ranks add up):
    - a CPU rank: its device figure above (host memory is its device);
    - a GPU rank: the larger of what a checkpoint's resume reads into host memory and what saving the
      result gathers there, plus the optimizer state and activations the plan offloads to the host. A replicated
      checkpoint (no parameter sharding) is read whole on every rank: the rank's trainable tensors
      (full: weights; LoRA: the adapter) and optimizer state, as the plan bills them. DCP (sharded)
      reads and writes in place, a tensor at a time, so nothing whole. The main rank of a full
      fine-tune gathers the whole model in host memory to save the result (params x stored bytes).
    Pretrained weights are copied from a memory-mapped file a tensor at a time, so loading adds nothing."""
    r = resolve(cfg)
    ledger = plan(cfg)
    hw = cfg.hardware
    _refuse_short_host(ledger.host, hw.host_mem)
    device_bytes, margin_bytes, host_bytes = [], [], []
    for rank, d in enumerate(ledger.devices):
        resident = (hw.cpu_runtime_mib if d.device.kind == "cpu" else hw.cuda_context_mib) * MiB
        need = d.need_bytes + int(d.device.capacity_bytes * hw.safety_margin) - resident
        device_bytes.append(max(0, need))
        margin_bytes.append(d.margin_bytes)
        if d.device.kind == "cpu":
            host_bytes.append(max(0, need))
            continue
        resume = 0 if r.dims.shards_params else _most(d, "adapter" if r.cfg.mode != "full" else "weights")
        resume += 0 if r.dims.shards_params else _most(d, "optimizer")
        result = r.spec.num_params * r.precision.param_bytes if rank == 0 and r.cfg.mode == "full" else 0
        host_bytes.append(max(resume, result) + d.offload_bytes + d.host_activation_bytes)
    return Bill(
        device_bytes=tuple(device_bytes),
        device_margin_bytes=tuple(margin_bytes),
        host_bytes=tuple(host_bytes),
        source=f"the {ledger.source} plan",
    )


def _most(d: DeviceLedger, component: str) -> int:
    """A component's largest figure over the rank's phases."""
    return max(phase.get(component, 0) for phase in d.phases.values())


def _refuse_short_host(host: DeviceLedger | None, declared: str | None) -> None:
    """A declared hardware.host_mem that cannot hold what the plan offloads to a node's host memory is
    the user's figure to fix before anything runs (undeclared, the preflight measures this machine's)."""
    if host is None or not declared or host.need_bytes <= host.usable_bytes:
        return
    what = " and ".join(c for c in ("optimizer", "activations") if host.components.get(c))
    raise ConfigError(
        "hardware.host_mem",
        f"{declared} cannot hold the {format_gib(host.need_bytes)} the plan offloads to a node's host memory "
        f"({what} of every rank on the node, {format_gib(host.usable_bytes)} usable)",
        "give the node's real RAM, or offload less (memory.offload_activations = false or "
        "parallel.offload_optimizer = false)",
    )
