"""Pipeline parallelism in the planner: the stage's receive buffers (plan/terms.py `comm_buffers` adds
them). The stage split itself is ParallelDims.stage_layers, shared with the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainplan.plan.context import RankContext


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
