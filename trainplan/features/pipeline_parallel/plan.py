"""Pipeline parallelism in the planner: the stage's receive buffers (plan/terms.py `comm_buffers` adds
them), and under DDP the window's gradients beside DDP's buckets (`adjust`). The stage split itself is
ParallelDims.stage_layers, shared with the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainplan.plan.context import RankContext
    from trainplan.plan.phase import StepBill
    from trainplan.plan.terms import RankTerms


def receive_buffers(ctx: RankContext) -> tuple[int, str]:
    """(bytes, note) of the receive buffers torch.distributed.pipelining's PipelineStage allocates at its
    first step and keeps for the run, one per micro-batch of the step (stage.py `_setup_forward_recv_info`,
    `_create_grad_recv_info`, torch 2.13): a stage after the first receives each micro-batch's hidden
    states, a stage before the last (when training) each micro-batch's gradient of its output. A stage
    sends its own output tensors, which the stage's activations hold already. Measured by
    tests/run/test_pipeline_parallel.py on the stage's own buffers."""
    if ctx.dims.pp == 1:
        return 0, ""
    micro = ctx.r.batch.grad_accum_steps
    one = ctx.tokens * ctx.spec.hidden_size * ctx.residual
    kinds = [("hidden states", not ctx.first), ("output gradients", not ctx.last and ctx.r.training)]
    held = [name for name, on in kinds if on]
    return len(held) * micro * one, f"pipeline receive buffers: {' and '.join(held)} of {micro} micro-batch(es)"


def adjust(ctx: RankContext, bill: StepBill, terms: RankTerms) -> StepBill:
    """What a training stage holds beside its layers' saved tensors:

    - a stage before the last: its output of every micro-batch in flight, which torch's PipelineStage
      keeps for that micro-batch's backward (in one process the next layer saves it, on the next stage);
    - stages replicated by DDP: PipelineStage runs every backward of the window but the last under DDP's
      no_sync, so the gradients accumulate in tensors of their own (zero_grad set them to None) beside
      DDP's buckets (the plan's gradients, which persist) until the last backward reduces them into the
      buckets: backward holds the gradients twice. Forward's peak does not (measured on 4 gloo ranks,
      pp 2 x dp 2: the last stage's loss moment of a later micro-batch stayed under its backward's).

    Measured by tests/run/test_pipeline_parallel.py (each stage's 1F1B step within 1 % of its plan)."""
    from trainplan.plan.phase import Bytes, PhaseBill, StepBill

    if ctx.dims.pp == 1 or not ctx.r.training:
        return bill
    phases, moments = dict(bill.phases), bill.moments
    if not ctx.last:
        kept = (
            "the stage's output of each micro-batch in flight, kept for its backward",
            ctx.in_flight * ctx.tokens * ctx.spec.hidden_size * ctx.residual,
        )
        phases["forward"] = PhaseBill(phases["forward"], activations=Bytes(phases["forward"]["activations"], kept))
        moments = tuple(PhaseBill(m, activations=Bytes(m.get("activations", 0), kept)) for m in moments)
    if ctx.dims.keeps_grad_buckets:
        twice = ("the window's gradients, beside DDP's buckets until its last backward (no_sync)", terms.grads.nbytes)
        moments = tuple(PhaseBill(m, gradients=Bytes(m.get("gradients", 0), twice)) for m in moments)
    if ctx.dims.shards_stages:
        return _sharded_stage(ctx, StepBill(phases=phases, moments=moments), terms)
    return StepBill(phases=phases, moments=moments)


def _sharded_stage(ctx: RankContext, bill: StepBill, terms: RankTerms) -> StepBill:
    """FSDP2 inside a stage (engine.py Pipeline): torch's PipelineStage runs every backward of the window
    but the last with resharding and the gradients' reduction off, so once a unit has run backward it
    stays gathered, and its gradients unsharded, until the window's last backward; then every unit, the
    root first, reduce-scatters its gradients (a flat copy of them in the reduction's dtype, and the
    shard it receives) and reshards. The load holds the root unit whole: the pipeline shards it once the
    stage's module exists."""
    from trainplan.plan.phase import Bytes, PhaseBill, StepBill

    cb = ctx.cb
    adapters = ctx.tensors.lora_numel(ctx.cfg.lora.r, ctx.adapters.targets, ctx.tp)  # summed once a stage
    trainable = ctx.n_held if ctx.full else adapters
    gathered = ("every unit of the stage gathered, kept through the window", (ctx.n_held + adapters) * cb)
    unsharded = ("the window's unsharded gradients, reduced at its last backward", trainable * cb)
    reduce_bytes = 4 if ctx.prec.grad_bytes == 4 else cb
    root = ctx.shards.root_numel if ctx.full else 0
    per_layer = ctx.shards.unit_numel if ctx.full else (adapters // len(ctx.layers) if ctx.layers else 0)
    first = root or per_layer  # the root's state reduces first (FSDP2's states in module order)
    flat = (
        "the first unit's gradients in flat copy for its reduce-scatter, and its shard",
        first * reduce_bytes + -(-first // ctx.dims.dp) * reduce_bytes,
    )
    held = {"weight_copies": Bytes(gathered), "gradients": Bytes(unsharded), "comm_buffers": terms.comm.steady}
    phases = dict(bill.phases)
    # forward: the first micro-batch's (the root's copy-out, features/sharding/plan.py), and once a backward
    # has run, every unit gathered beside the window's gradients (no unit reduces before the end)
    later = PhaseBill(phases["forward"], **held)
    moments = tuple(PhaseBill(m, **held) for m in bill.moments) + (later,)
    start = bill.moments[0]
    reduce = PhaseBill(
        {k: start[k] for k in ("weights", "adapter", "optimizer", "buffers") if k in start},
        **held,
        activations=Bytes(flat),
    )
    load = phases["load"]
    whole = ctx.shards.root_numel - -(-ctx.shards.root_numel // ctx.dims.dp)
    stored = ctx.prec.param_bytes if ctx.full else ctx.prec.frozen_bytes
    whole_root = ("the root unit whole until the stage shards it", whole * stored)
    phases["load"] = PhaseBill(load, weight_copies=Bytes(load.get("weight_copies", 0), whole_root))
    return StepBill(phases=phases, moments=(*moments, reduce))
