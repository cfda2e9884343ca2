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
    return StepBill(phases=phases, moments=moments)
