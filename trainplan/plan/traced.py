"""The traced plan: run the real model code on fake tensors and record what it allocates.

The model comes from run/build.py (the builder the training engine uses) and the step from
run/step.py (the step the training loop runs). Nothing is allocated; every tensor's size is
known. The one user of private PyTorch APIs is trainplan/_torch_private.py.

Ranks: FSDP (zero3, fsdp-grad-op) is traced per rank with a fake process group of the
data-parallel size. DDP and ZeRO-1/2 are derived from the single-rank trace plus the sharding
arithmetic; the output says which rows were traced and which derived.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from trainplan import features, resolve
from trainplan.config import RunConfig
from trainplan.errors import TrainplanError
from trainplan.plan import analytic, fragmentation
from trainplan.plan.analytic import ZERO2_BUCKET_BYTES
from trainplan.plan.ledger import GROUPS, Ledger
from trainplan.plan.tracestep import rank_zero, traced_step
from trainplan.spec.model import ModelSpec


@dataclass(kw_only=True)
class TraceResult:
    phases: dict[str, dict[str, int]]  # ledger components per phase, at that phase's peak
    raw: dict[str, dict[str, int]]  # tracker categories per phase
    rows: dict[str, str]  # component -> "traced" | "derived: why"
    world_size: int
    seconds: float
    max_rss_bytes: int
    notes: list[str] = field(default_factory=list)
    # the allocation stream replayed through the CUDA caching allocator's rules (plan/allocator.py):
    # allocator mode ("default", "expandable_segments") -> phase of the measured step -> peak reserved bytes
    reserved: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_bytes(self) -> int:
        return sum(self.phases[self.peak_phase].values())


def trace(cfg: RunConfig, spec: ModelSpec | None = None, *, real: bool = False) -> tuple[TraceResult, resolve.Resolved]:
    """Trace one warm-up and one measured step on fake tensors; per-phase peaks of the measured one.

    real=True runs the very same step on real, randomly initialized CPU tensors instead: the
    validation that fake tracing allocates what a real run allocates (small models only).
    """
    from trainplan.plan.analytic import choose_checkpointing

    cfg, _ = choose_checkpointing(cfg, spec)  # "auto": the planner's choice is what is traced
    r = resolve.resolve(cfg, spec)
    features.check_traceable(r)
    if real and (r.dims.shards_params or r.dims.tp > 1 or r.dims.cp > 1):
        raise TrainplanError("trace: real-tensor validation runs one process; FSDP, tp and cp need torchrun")
    from trainplan import _torch_private as P
    from trainplan.run import measure

    P.check_torch_version()
    t0 = time.perf_counter()
    dims = r.dims
    target = "cuda" if r.devices[0].is_gpu else "cpu"
    fsdp = dims.shards_params
    world = dims.dp if fsdp else 1  # the data-parallel replicas, over which the loss's tokens are counted
    ranks = dims.world_size if fsdp or dims.tp > 1 or dims.pp > 1 or dims.cp > 1 else 1  # rank 0, peers faked
    events: list | None = [] if target == "cuda" else None
    with rank_zero(dims, ranks) as mesh:
        phases, adapter_params, states, shapes, micro_steps = traced_step(
            r, real=real, target=target, world=world, mesh=mesh, events=events
        )

    lora = cfg.mode == "lora"
    comps = {
        ph: measure.to_components(raw, adapter_params=adapter_params, states=states, lora=lora, phase=ph)
        for ph, raw in phases.items()
    }
    rows = {c: "traced" for ph in comps.values() for c in ph}
    notes = [
        f"traced on {'real' if real else 'fake'} CPU tensors: "
        f"{'rank 0 of ' + str(ranks) + ' (' + dims.describe() + ')' if ranks > 1 else 'one rank'}, "
        f"{micro_steps} micro-batch(es) per step, measured on the second step"
    ]
    if not fsdp and dims.keeps_grads_between_steps and cfg.mode != "inference":
        _derive_data_parallel(comps, rows, dims, r, shapes)
        notes.append(f"{dims.strategy} rows derived from the single-rank trace (dp {dims.dp})")
    if features.torch_compile.active(r):
        notes.append(
            "train.compile: traced eagerly (a fake-tensor trace is a dispatch mode, under which compiled frames "
            "run eagerly); `trainplan plan` asks inductor's partitioner what the compiled layers save, and "
            "`trainplan accept` measures the compiled step"
        )
    if target == "cuda":
        notes.append(
            "traced with CPU kernels: CUDA-only kernels (flash attention's saved tensors, fused "
            "cross-entropy) and CUDA autocast's op lists may differ"
        )
    rss = measure.max_rss_bytes()
    workspace = cfg.hardware.cublas_workspace_mib << 20
    reserved = replay_reserved(events, phases, workspace_bytes=workspace) if events else {}
    return TraceResult(
        phases=comps,
        raw=phases,
        rows=rows,
        world_size=ranks,
        seconds=time.perf_counter() - t0,
        max_rss_bytes=rss,
        notes=notes,
        reserved=reserved,
    ), r


def replay_reserved(events: list, phases, *, workspace_bytes: int) -> dict[str, dict[str, int]]:
    """Peak reserved bytes per measured phase, for the allocator's default mode and expandable segments.
    The cuBLAS workspace comes from the same allocator, before the first step's first matmul."""
    from trainplan.plan.allocator import AllocatorConfig, replay

    stream = [("alloc", "cublas workspace", workspace_bytes), *events] if workspace_bytes else events
    out = {}
    for mode, expandable in (("default", False), ("expandable_segments", True)):
        result = replay(stream, AllocatorConfig(expandable_segments=expandable))
        out[mode] = {ph: result.phase_peaks[ph][0] for ph in phases if ph in result.phase_peaks}
    return out


def _derive_data_parallel(comps: dict[str, dict[str, int]], rows: dict[str, str], dims, r, shapes) -> None:
    """DDP keeps gradients in its buckets; ZeRO-1 shards optimizer state (rank 0's share of
    ZeroRedundancyOptimizer's partition); ZeRO-2 also gradients (evenly)."""
    dp = dims.dp
    total = sum(math.prod(s) for s in shapes)
    share = 1 / dp
    if dims.partitions_optimizer_by_tensor and total:
        share = sum(math.prod(s) for s in analytic.zero1_partition(shapes, dp)[0]) / total
    grads = comps["optimizer"].get("gradients", 0)
    for ph in ("forward", "backward"):
        if dims.keeps_grad_buckets:
            comps[ph]["gradients"] = max(comps[ph].get("gradients", 0), grads)
            rows["gradients"] = "derived: DDP buckets hold the gradients between steps"
        elif dims.keeps_grad_partition:
            comps[ph]["gradients"] = max(comps[ph].get("gradients", 0) // dp, grads // dp)
    if dims.shards_optimizer:  # zero1 or zero2 here: FSDP is traced per rank, not derived
        for ph in comps:
            for c in ("optimizer", "optimizer_temp"):
                if c in comps[ph]:
                    comps[ph][c] = math.ceil(comps[ph][c] * share)
        rows["optimizer"] = f"derived: {dims.strategy} shards optimizer state over dp {dp} (rank 0: {share:.1%})"
    if dims.keeps_grad_partition:
        comps["optimizer"]["gradients"] = -(-grads // dp)
        comps["backward"]["comm_buffers"] = min(ZERO2_BUCKET_BYTES, grads)
        rows["gradients"] = f"derived: zero2 shards gradients over dp {dp}"


def _whole_run(analytic_phases: dict, traced_phases: dict) -> dict:
    """The traced step between the analytic plan's load and its evaluate and save phases: the
    tracer runs the step only."""
    out = {"load": analytic_phases["load"]} if "load" in analytic_phases else {}
    out.update(traced_phases)
    out.update({ph: analytic_phases[ph] for ph in ("evaluate", "save") if ph in analytic_phases})
    return out


def _why(traced, analytic) -> dict[str, str]:
    """The trace's own why-lines: where its peak is, and each component there beside the analytic
    plan's figure for the same phase, with the analytic term's reasoning."""
    from trainplan.plan.ledger import gib

    phase = traced.peak_phase
    source = "the analytic plan (not traced)" if phase in ("load", "evaluate", "save") else "the fake tensors"
    out = {phase: f"the most {source} held at once during {phase}, on the measured (second) step"}
    planned = analytic.phases.get(phase, {})
    for component, nbytes in traced.phases[phase].items():
        if not nbytes:
            continue
        line = f"traced {gib(nbytes)}; the analytic plan has {gib(planned.get(component, 0))} here"
        reason = analytic.explain.get(component)
        out[component] = f"{line} ({reason})" if reason else line
    return out


def _replayed_reserve(device, replayed: dict[str, int], workspace: int, miss: tuple[float, str]) -> None:
    """The allocator reserve from the replay: its peak reserved over the traced phases, less the cuBLAS
    workspace (billed under runtime) and the tensors' own peak, plus the replay's measured miss for the
    workload class: a row the replay under-predicted by a fraction m of its measured reserved bytes
    reserved replayed / (1 - m), so that much more is kept."""
    peak = device.peak_allocated
    fraction, why = miss
    top = max(replayed.values())
    extra = math.ceil(top * fraction / (1 - fraction)) if fraction else 0
    reserve = max(0, top - workspace - peak) + extra
    device.reserve_fraction = reserve / peak if peak else 0.0
    device.reserve_source = "the traced step replayed through the caching allocator's rules (plan/allocator.py)"
    if extra:
        device.reserve_source += f", plus {fraction:.2%} of it: {why}"
    device.replayed_reserved = {ph: v - workspace for ph, v in replayed.items()}


def traced_ledger(result: TraceResult, r: resolve.Resolved, analytic_ledger: Ledger) -> Ledger:
    """The traced bill as a Ledger (runtime and allocator reserve from the analytic settings)."""
    devices = []
    replayed = result.reserved.get("expandable_segments" if r.cfg.memory.expandable_segments else "default", {})
    ac = r.cfg.memory.activation_checkpointing
    miss = fragmentation.replay_miss(r.cfg.mode, ac is not False and ac != 0)
    for proto in analytic_ledger.devices:
        device = dataclasses.replace(  # the traced step is the figure itself: no error band on it
            proto, phases=_whole_run(proto.phases, result.phases), explain={}, details={}, error_band=0.0
        )
        if replayed and proto.device.kind != "cpu":
            _replayed_reserve(device, replayed, r.cfg.hardware.cublas_workspace_mib << 20, miss)
        device.explain.update(_why(device, proto))
        devices.append(device)
    return Ledger(
        model=analytic_ledger.model,
        settings=analytic_ledger.settings,
        devices=devices,
        notes=result.notes,
        source="traced",
    )


def compare(result: TraceResult, analytic_ledger: Ledger) -> list[dict]:
    """Per phase and group: analytic bytes, traced bytes, and the difference relative to traced peak."""
    led = analytic_ledger.devices[0]
    peak = result.peak_bytes
    rows = []
    for phase in result.phases:
        a_ph, t_ph = led.phases.get(phase, {}), result.phases[phase]
        for group, comps in [*GROUPS.items(), ("total", None)]:
            keys = comps or tuple(set(a_ph) | set(t_ph))
            a = sum(a_ph.get(c, 0) for c in keys)
            t = sum(t_ph.get(c, 0) for c in keys)
            rows.append(
                {
                    "phase": phase,
                    "group": group,
                    "analytic": a,
                    "traced": t,
                    "diff": a - t,
                    "diff_of_peak": (a - t) / peak if peak else 0.0,
                }
            )
    return rows
