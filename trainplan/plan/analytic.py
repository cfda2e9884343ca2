"""The analytic plan: closed-form bytes per component, per phase, per rank. Imports no torch.

Phases of a training step and what is live in each (torch semantics, zero_grad(set_to_none)):
  forward   weights, weight copies, optimizer states, persistent gradients, all saved
            activations, the loss's logits buffers
  backward  the same at the start of backward, where saved activations are all still live,
            plus the logits/loss gradients and the first gradients (lm_head)
  optimizer weights, all gradients, optimizer states and the step's temporaries
Gradients persist into forward when DDP keeps them in its buckets, when ZeRO-2 keeps its
partition, and whenever gradient accumulation spans more than one micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from trainplan import config as C
from trainplan import features
from trainplan.features.activation_offload import plan as activation_offload
from trainplan.features.checkpointing import plan as checkpointing
from trainplan.features.optimizer_offload import plan as optimizer_offload
from trainplan.features.pipeline_parallel import plan as pipeline_parallel
from trainplan.features.sharding import plan as sharding
from trainplan.features.step_in_backward import plan as step_in_backward
from trainplan.plan import context, lifecycle, offload, packing
from trainplan.plan import terms as T
from trainplan.plan.backward import backward_moments
from trainplan.plan.formulas import kv_cache_bytes, model_state_bytes_per_param, zero_model_state_bytes
from trainplan.plan.ledger import DeviceLedger, Ledger, gib
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill, StepBill
from trainplan.plan.tensors import (
    BNB_8BIT_MIN_NUMEL,
    BNB_BLOCK,
    NF4_BYTES,
    NF4_CONSTANTS_BYTES,
    ROWWISE,
    ZERO2_BUCKET_BYTES,
    optimizer_state_bytes,
    optimizer_temp_bytes,
    zero1_partition,
)
from trainplan.resolve import Resolved, resolve
from trainplan.spec.devices import DeviceSpec, MiB
from trainplan.spec.model import ModelSpec
from trainplan.spec.parallel import ParallelDims

__all__ = [  # what other modules import from here; the terms themselves live in plan/terms.py
    "BNB_8BIT_MIN_NUMEL",
    "BNB_BLOCK",
    "NF4_BYTES",
    "NF4_CONSTANTS_BYTES",
    "ROWWISE",
    "ZERO2_BUCKET_BYTES",
    "kv_cache_bytes",
    "model_state_bytes_per_param",
    "optimizer_state_bytes",
    "optimizer_temp_bytes",
    "plan",
    "resolve",
    "zero1_partition",
    "zero_model_state_bytes",
]


# ---- one rank --------------------------------------------------------------------------------


def _backward_copies(ctx: T.RankContext, copies: int) -> int:
    """autocast's weight copies at the start of backward: all of forward's, unless checkpointing
    released the layers' (T.casts_kept_by_checkpointing)."""
    if ctx.ckpt.layers and ctx.autocast and ctx.full and not ctx.shards.fsdp:
        return Bytes(
            (
                "autocast's copies outside the checkpoints: the rest were dropped with forward's cache",
                T.casts_kept_by_checkpointing(ctx),
            )
        )
    return copies


class _Fixed(NamedTuple):
    """One rank's terms that do not depend on the micro-batch (given whether gradients persist)."""

    weights: T.Term
    copies: T.Term
    adapter: T.AdapterTerm
    grads: T.GradTerm
    opt: T.OptTerm
    buffers: int
    runtime: int
    load: dict[str, int]
    save: dict[str, int]
    host_bytes: int
    explain: dict[str, str]  # the notes of the terms above but the load's and the save's
    noted: dict[str, int]  # the bytes each of those notes explains
    load_note: str
    save_note: str


def _fixed_terms(ctx: T.RankContext) -> _Fixed:
    weights, copies, adapter = T.weights(ctx), T.weight_copies(ctx), T.adapter(ctx)
    grads, opt = T.gradients(ctx), T.optimizer(ctx)
    explain: dict[str, str] = {"weights": weights.note}
    for key, term in (("weight_copies", copies), ("adapter", adapter), ("gradients", grads), ("optimizer", opt)):
        if term.note:
            explain[key] = term.note
    explain["optimizer_temp"] = opt.temp_note
    host_bytes, opt, adapter = optimizer_offload.on_host(ctx, grads, opt, adapter, explain)
    buffers = T.buffers(ctx)
    explain["buffers"] = T.BUFFERS_NOTE
    noted = {
        "weights": weights.nbytes,
        "weight_copies": copies.nbytes,
        "gradients": grads.nbytes,
        "optimizer": opt.states,
        "optimizer_temp": opt.temp,
        "buffers": buffers,
    }
    load, load_note = lifecycle.load(ctx, weights, adapter, buffers)
    save, save_note = lifecycle.save(ctx, weights, adapter, grads, opt, buffers)
    runtime = T.runtime(ctx)
    return _Fixed(
        weights,
        copies,
        adapter,
        grads,
        opt,
        buffers,
        runtime,
        load,
        save,
        host_bytes,
        explain,
        noted,
        load_note,
        save_note,
    )


# The features that reshape a training rank's step, in the order they apply (features/<name>/plan.py):
# each returns the step as it was where its feature is off. Checkpointing adds backward's recompute
# moment; the step in backward bills every moment one gradient at a time and drops the optimizer phase;
# activation offload may move forward's peak; FSDP2's optimizer offload takes what lives on the host out
# of every phase and moment, so it comes last. (Features that change one component's size, LoRA's
# adapters, QLoRA's NF4 weights, 8-bit states, a compiled layer's saved bytes, are read by its term.)
ADJUSTMENTS = (checkpointing.adjust, step_in_backward.adjust, activation_offload.adjust, optimizer_offload.adjust)
ADJUSTMENTS += (sharding.adjust, pipeline_parallel.adjust)  # the pipeline's last: it doubles backward's gradients


def _rank_ledger(r: Resolved, rank: int, memo: dict | None = None) -> DeviceLedger:
    """One rank's bill: the terms of plan/terms.py, per phase, with the peak moment of backward.
    `memo`: this rank's, kept across plans of the same job at other micro-batches (the advisor's
    search): the terms the micro-batch does not change are computed once."""
    ctx = context.rank_context(r, rank, memo.get("ctx") if memo else None)
    fixed = memo.get(ctx.persistent_grads) if memo else None
    if fixed is None:
        fixed = _fixed_terms(ctx)
        if memo is not None:
            memo.setdefault("ctx", ctx)
            memo[ctx.persistent_grads] = fixed
    weights, copies, adapter, grads, opt = fixed.weights, fixed.copies, fixed.adapter, fixed.grads, fixed.opt
    buffers, runtime, load, host_bytes = fixed.buffers, fixed.runtime, fixed.load, fixed.host_bytes
    explain, noted = dict(fixed.explain), dict(fixed.noted)
    comm = T.comm_buffers(ctx, grads.nbytes)
    if comm.note:
        explain["comm_buffers"] = comm.note
    explain["load"] = fixed.load_note
    if not r.training:
        return _inference_ledger(ctx, weights.nbytes, buffers, runtime, explain, noted, load)

    acts = T.activations(ctx)
    explain["activations"] = acts.note
    details = {"activations (one layer)": T.layer_saved_details(ctx)}
    loss = T.logits_loss(ctx, grads)
    if loss.note:
        explain["logits_loss"] = loss.note
    forward = PhaseBill(
        weights=weights.nbytes,
        weight_copies=copies.nbytes,
        adapter=adapter.live,
        gradients=grads.live_fwd,
        optimizer=opt.states,
        activations=acts.fwd,
        logits_loss=loss.by_phase["forward"],
        buffers=buffers,
        comm_buffers=comm.steady,
    )
    backward_start = PhaseBill(
        weights=weights.nbytes,
        weight_copies=_backward_copies(ctx, copies.nbytes),
        adapter=adapter.backward_live + (adapter.grads if ctx.persistent_grads else 0),
        gradients=Bytes(grads.live_fwd, loss.by_phase["backward_grads"]),
        optimizer=opt.states,
        activations=acts.bwd,
        logits_loss=loss.by_phase["backward"],
        buffers=buffers,
        comm_buffers=comm.steady,
    )
    optimizer = PhaseBill(
        weights=weights.nbytes,
        adapter=adapter.weights + adapter.states + adapter.grads,
        gradients=grads.nbytes,
        optimizer=opt.states,
        optimizer_temp=opt.temp,
        activations=Bytes(("the batch's ids and labels, still referenced", 2 * ctx.tokens * 8)),
        buffers=buffers,
        comm_buffers=comm.steady,  # a pipeline stage keeps its receive buffers for the run
    )
    evaluate, explain["evaluate"] = lifecycle.evaluate(ctx, weights, copies, adapter, grads, opt, buffers, comm)
    explain["save"] = fixed.save_note
    save = PhaseBill(fixed.save, comm_buffers=comm.steady) if comm.steady else fixed.save
    bill = StepBill(
        phases={"load": load, "forward": forward, "optimizer": optimizer, "evaluate": evaluate, "save": save},
        moments=tuple(backward_moments(ctx, backward_start, adapter, grads, acts, comm)),
    )
    terms = T.RankTerms(weights, copies, adapter, grads, opt, acts, loss, comm)
    for adjust in ADJUSTMENTS:
        bill = adjust(ctx, bill, terms)
    backward = {"backward": max(bill.moments, key=lambda c: c.total)}
    phases = {name: bill.phases[name] for name in ("load", "forward")} | backward
    phases |= {name: bill.phases[name] for name in ("optimizer", "evaluate", "save") if name in bill.phases}
    return _device_ledger(
        r,
        rank,
        phases,
        runtime,
        explain,
        details,
        noted=noted,
        offload_bytes=host_bytes,
        offloaded_activation_bytes=acts.offloaded,
        host_activation_bytes=acts.host,
    )


def _label(device: DeviceSpec, rank: int) -> str:
    return f"cpu {rank}" if device.kind == "cpu" else f"GPU {rank}"


@functools.lru_cache(maxsize=4096)
def _role(dims: ParallelDims, rank: int) -> str:
    stage, dp_i, tp_i = dims.coords(rank)
    parts = []
    if dims.pp > 1:
        parts.append(f"stage {stage}/{dims.pp}")
    if dims.tp > 1:
        parts.append(f"tp {tp_i}")
    parts.append(dims.strategy)
    return ", ".join(parts) + f" rank {rank}"


def _device_ledger(
    r: Resolved,
    rank: int,
    phases: dict,
    runtime: int,
    explain: dict,
    details: dict,
    *,
    noted: dict,
    offload_bytes: int = 0,
    offloaded_activation_bytes: int = 0,
    host_activation_bytes: int = 0,
) -> DeviceLedger:
    from trainplan.plan import accuracy

    device = r.devices[rank]
    band, band_source = accuracy.band(r.spec.model_type, r.cfg.mode, derived=r.spec.derived)
    band, band_source = features.tiled_mlp.band(r, band, band_source)
    reserve, reserve_source = allocator_reserve(r.cfg)
    led = DeviceLedger(
        label=_label(device, rank),
        device=device,
        role=_role(r.dims, rank),
        phases=phases,
        runtime_bytes=runtime,
        reserve_fraction=0.0 if device.kind == "cpu" else reserve,
        reserve_source="" if device.kind == "cpu" else reserve_source,
        allocator_mode="expandable_segments" if r.cfg.memory.expandable_segments else "default",
        safety_margin=r.cfg.hardware.safety_margin,
        explain=explain,
        noted=noted,
        details=details,
        ranks=[rank],
        offload_bytes=offload_bytes,
        offloaded_activation_bytes=offloaded_activation_bytes,
        host_activation_bytes=host_activation_bytes,
        error_band=band,
        error_band_source=band_source,
        budget_bytes=r.budget_bytes,
    )
    _runtime_explain(led, r.cfg, reserve_source)
    return led


def allocator_reserve(cfg: C.RunConfig) -> tuple[float, str]:
    """(fraction of the peak allocated that the caching allocator holds beyond the tensors, why):
    hardware.allocator_reserve when set, else the worst measured for the workload class."""
    from trainplan.plan import fragmentation

    if cfg.hardware.allocator_reserve is not None:
        return cfg.hardware.allocator_reserve, "hardware.allocator_reserve"
    ac = cfg.memory.activation_checkpointing
    return fragmentation.reserve_fraction(
        cfg.mode, ac is not False and ac != 0, expandable=cfg.memory.expandable_segments
    )


def _runtime_explain(led: DeviceLedger, cfg: C.RunConfig, reserve_source: str) -> None:
    if led.device.kind == "cpu":
        led.explain["runtime"] = (
            f"python + torch libraries, {cfg.hardware.cpu_runtime_mib} MiB (hardware.cpu_runtime_mib)"
        )
    else:
        led.explain["runtime"] = (
            f"CUDA context {cfg.hardware.cuda_context_mib} MiB + cuBLAS workspace "
            f"{cfg.hardware.cublas_workspace_mib} MiB (hardware.*_mib)"
        )
        offload = led.runtime_bytes - (cfg.hardware.cuda_context_mib + cfg.hardware.cublas_workspace_mib) * MiB
        if offload > 0:  # terms.offload_untracked
            note = T.OFFLOAD_UNTRACKED_NOTE.format(factor=T.OFFLOAD_UNTRACKED, size=gib(offload))
            led.explain["runtime"] += f"; {note}"
        led.explain["allocator_reserve"] = (
            f"{led.reserve_fraction:.1%} of peak allocated held by the caching allocator beyond the tensors: "
            f"{reserve_source}"
        )


def _inference_ledger(
    ctx: T.RankContext, weights: int, buffers: int, runtime: int, explain: dict, noted: dict, load: dict
) -> DeviceLedger:
    """Inference: weights + KV cache + the largest transient; no gradients, no optimizer."""
    phases = {"load": load, "inference": lifecycle.inference(ctx, weights, buffers, explain, noted)}
    return _device_ledger(ctx.r, ctx.rank, phases, runtime, explain, {}, noted=noted)


# ---- the whole plan --------------------------------------------------------------------------


def plan(cfg: C.RunConfig, spec: ModelSpec | None = None) -> Ledger:
    cfg, note = choose_checkpointing(cfg, spec)
    r = resolve(cfg, spec)
    ledger = plan_resolved(r)
    if note:
        ledger.notes.insert(1, note)
    ledger.runnable = runnable(r)
    return ledger


def runnable(r: Resolved) -> dict:
    """{"ok", "why"}: whether `trainplan train` runs this job as planned. A plan of a layout the engine
    does not run still prints (planning hardware you do not have is the point), and says so."""
    from trainplan.errors import NotRunnable
    from trainplan.resolve import model_facts, require_runnable

    try:
        require_runnable(r.cfg, r.dims, cuda=all(d.is_gpu for d in r.devices), **model_facts(r.spec))
    except NotRunnable as e:
        return {"ok": False, "why": str(e), "field": e.field}
    return {"ok": True, "why": ""}


def choose_checkpointing(cfg: C.RunConfig, spec: ModelSpec | None = None) -> tuple[C.RunConfig, str | None]:
    """cfg as it runs, and why: anything but "auto" is returned as it is, with no note. Every
    command that plans, traces or runs a config passes it through here first.

    memory.activation_checkpointing = "auto": the fewest checkpointed layers (the least
    recompute) whose plan fits every device, under hardware.memory_budget where one is set;
    (cfg with that count, the reason in one line). Each checkpointed layer keeps its input instead
    of its saved tensors, so memory falls as the count grows: a binary search between none and
    every layer, each step a full plan. The answer is always planned and fits, unless even every
    layer does not fit: then every layer, and the plan says what does not fit."""
    if cfg.memory.activation_checkpointing != "auto":
        return cfg, None
    spec = spec or resolve(cfg).spec

    def at(n: int) -> C.RunConfig:
        value: bool | int = n if 0 < n < spec.num_layers else n > 0
        return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, activation_checkpointing=value))

    def fits(n: int) -> Ledger:
        return plan_resolved(resolve(at(n), spec))

    if cfg.mode == "inference":
        return at(0), "activation checkpointing auto: inference saves nothing for backward, so none"
    layers = spec.num_layers
    none = fits(0)
    if none.fits:
        d = min(none.all_ledgers, key=lambda x: x.headroom_bytes)
        return at(0), (
            f"activation checkpointing auto: none; the run fits without it (least headroom {gib(d.headroom_bytes)} "
            f"on {d.label})"
        )
    every = fits(layers)
    if not every.fits:
        return at(layers), "activation checkpointing auto: every layer, and even so the run does not fit (below)"
    lo, hi, over = 0, layers, none  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ledger = fits(mid)
        if ledger.fits:
            hi = mid
        else:
            lo, over = mid, ledger
    d = min(over.all_ledgers, key=lambda x: x.headroom_bytes)
    what = "every layer" if hi == layers else f"{hi} of {layers} layers"
    fewer = "none" if lo == 0 else f"{lo} layers"
    return at(hi), (
        f"activation checkpointing auto: {what}, the fewest that fit every device (with {fewer}, {d.label} is over "
        f"by {gib(-d.headroom_bytes)}{' of hardware.memory_budget' if d.budget_bytes is not None else ''})"
    )


def plan_resolved(r: Resolved, memo: dict | None = None) -> Ledger:
    """The plan of a job already resolved (the advisor resolves a rung once, then varies its batch).
    `memo`: one dict per job, passed to each of its plans that differ only in the micro-batch: the
    terms the micro-batch does not change are computed once (`_rank_ledger`), and each bill once."""
    from trainplan.plan import derived

    r = derived.attach(r)
    bills: dict[tuple, DeviceLedger] = {}
    ledgers = []
    for rank, key in _bill_keys(r.dims, tuple(r.devices), r.training):
        if key not in bills:
            bills[key] = _bill(r, rank, key, memo)
        device = r.devices[rank]
        ledgers.append(
            bills[key].for_rank(label=_label(device, rank), device=device, role=_role(r.dims, rank), rank=rank)
        )
    offloaded = any(led.offload_bytes or led.host_activation_bytes for led in ledgers)  # none on the CPU
    host = offload.host_ledger(r.cfg, ledgers, fsdp2=r.dims.shards_params) if offloaded else None
    return Ledger(model=r.spec.summary(), settings=_settings(r), devices=ledgers, host=host, notes=_notes(r))


def fits_resolved(r: Resolved, memo: dict) -> bool:
    """plan_resolved(r, memo).fits, planning one bill at a time and stopping at the first over its
    device: the advisor's binary search over the micro-batch asks this of most candidates. The bills
    planned stay in `memo`, for plan_resolved of the same micro-batch."""
    from trainplan.plan import derived

    r = derived.attach(r)
    if features.optimizer_offload.on(r.cfg) or features.activation_offload.on(r.cfg):  # the host sums every rank's
        return plan_resolved(r, memo).fits
    seen = set()
    for rank, key in _bill_keys(r.dims, tuple(r.devices), r.training):
        if key not in seen:
            seen.add(key)
            if not _bill(r, rank, key, memo).fits:
                return False
    return True


@functools.lru_cache(maxsize=1024)
def _bill_keys(dims: ParallelDims, devices: tuple[DeviceSpec, ...], training: bool) -> tuple[tuple[int, tuple], ...]:
    """(rank, key) for every rank: ranks with the same key have the same bill."""
    out = []
    for rank, device in enumerate(devices):
        stage, dp_i, _ = dims.coords(rank)
        # ZeRO-1's partition is uneven: each data-parallel rank has its own bill
        key = (stage, device, dp_i if dims.partitions_optimizer_by_tensor else 0)
        if (dims.shards_params or dims.tp > 1) and device.kind == "cpu" and training:
            key += (rank == 0,)  # saving: the main CPU rank keeps the gathered state dict
        out.append((rank, key))
    return tuple(out)


def _bill(r: Resolved, rank: int, key: tuple, memo: dict | None) -> DeviceLedger:
    """The bill of `rank` (the first with this key), from the memo when this micro-batch's is there."""
    if memo is None:
        return _rank_ledger(r, rank)
    slot = memo.setdefault(key, {})
    at = ("bill", r.batch.micro_batch_size)
    if at not in slot:
        slot[at] = _rank_ledger(r, rank, slot)
    return slot[at]


def _settings(r: Resolved) -> dict:
    cfg, b = r.cfg, r.batch
    settings = {
        "mode": cfg.mode,
        "precision": cfg.precision,
        "micro_batch_size": b.micro_batch_size,
        "grad_accum_steps": b.grad_accum_steps,
        "data_parallel": b.dp,
        "global_batch_size": b.global_batch_size,
        "seq_len": b.seq_len,
        "tokens_per_step": b.tokens_per_step,
        "parallel": r.dims.describe(),
        "strategy": r.dims.strategy,
        "tp": r.dims.tp,
        "pp": r.dims.pp,
        "optimizer": cfg.optim.name,
        "activation_checkpointing": cfg.memory.activation_checkpointing,
        "attention": r.attention,
        "lora": (
            {
                "r": cfg.lora.r,
                "alpha": cfg.lora.alpha,
                "dropout": cfg.lora.dropout,
                "target_modules": cfg.lora.target_modules,
            }
            if features.lora.on(cfg)
            else None
        ),
    }
    settings["summary"] = (
        f"{cfg.mode}, {cfg.precision}, micro-batch {b.micro_batch_size} x accum "
        f"{b.grad_accum_steps} x dp {b.dp} = global {b.global_batch_size}, seq {b.seq_len}, "
        f"{r.dims.describe()}" + _checkpointing_text(r) + f", {r.attention} attention"
    )
    return settings


def _checkpointing_text(r: Resolved) -> str:
    n, layers = r.checkpointed_layers, r.spec.num_layers
    if not n:
        return ""
    return ", activation checkpointing" + ("" if n == layers else f" ({n} of {layers} layers)")


def _notes(r: Resolved) -> list[str]:
    b = r.batch
    notes = [
        "Analytic estimate from closed-form terms (docs/memory-model.md); `trainplan trace` runs the real "
        "model on fake tensors for the exact figure.",
    ]
    if r.spec.derived:
        fit = r.spec.layer_fit
        notes.append(
            f"{r.spec.model_type} has no hand-written terms: each decoder layer's saved bytes are derived from a "
            f"trace of the real module with 1 and 2 layers ({fit.a:,.0f} B per token + {fit.c:,.2f} B per b*s^2 + "
            f"{fit.e:,.0f} B per position + {fit.d:,.0f} B), and the parameters from its own layout; the embedding, "
            "head, loss and the backward moments are the hand-written terms of a Llama-style stack."
        )
    if r.spec.learned_positions == 0 and b.seq_len > r.spec.max_position_embeddings:
        notes.append(
            f"seq_len {b.seq_len} exceeds the model's max_position_embeddings "
            f"{r.spec.max_position_embeddings}: quality beyond it is not assured."
        )
    if r.cfg.mode == "full" and any(d.kind == "cuda" for d in r.devices):
        state = r.spec.num_params * r.precision.param_bytes
        notes.append(
            f"Saving the result copies the full model to the main rank's host memory: {gib(state)} in "
            f"{'fp32' if r.precision.param_bytes == 4 else r.precision.compute_dtype}, plus one serialized "
            f"shard of at most {gib(min(state, lifecycle.SHARD_BYTES))} (run/result.py)."
        )
    if any(d.kind == "cuda" for d in r.devices) and r.dims.world_size > 1:
        notes.append("NCCL's own buffers and per-peer channels are not in the bill yet.")
    notes += packing.notes(r)
    return notes
