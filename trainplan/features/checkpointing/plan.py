"""Activation checkpointing in the plan: a checkpointed layer keeps its input (plan/terms.py `activations`
bills it), and backward gains a moment of its own, the top checkpointed layer's recompute."""

from __future__ import annotations

from trainplan.features.sharding.plan import defers_buffers
from trainplan.plan.context import RankContext
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill, StepBill
from trainplan.plan.terms import (
    ActTerm,
    AdapterTerm,
    GradTerm,
    RankTerms,
    casts_kept_by_checkpointing,
)


def adjust(ctx: RankContext, bill: StepBill, terms: RankTerms) -> StepBill:
    if not ctx.ckpt.layers:
        return bill
    start, end = bill.moments[0], bill.moments[1]
    recompute = _recompute(ctx, start, end, terms.adapter, terms.grads, terms.acts)
    phases = bill.phases
    inside = _inside_top_layer(ctx, phases["forward"], terms.acts)
    if inside.total > phases["forward"].total:
        phases = {**phases, "forward": inside}
    return StepBill(phases=phases, moments=(*bill.moments, recompute))


def _inside_top_layer(ctx: RankContext, forward: PhaseBill, acts: ActTerm) -> PhaseBill:
    """Forward's other candidate peak: inside the top checkpointed layer's forward, with every
    checkpointed layer's input kept and no layer above run yet (a small vocabulary's loss, or a
    pipeline stage without the head, leaves it the peak)."""
    return forward.with_(
        weight_copies=Bytes(forward["weight_copies"], _fsdp_buffer(ctx, "forward")),
        activations=Bytes(
            acts.inputs,
            (
                "what the checkpointed layers keep, the top one's included",
                ctx.in_flight * ((ctx.ckpt.layers - 1) * acts.kept_on_device + acts.kept),
            ),
            ("inside the top checkpointed layer's forward", checkpointed_layer_forward(ctx)),
        ),
        logits_loss=0,
    )


def _fsdp_buffer(ctx: RankContext, when: str) -> tuple[str, int]:
    """Under FSDP2 with its buffers (features/sharding/plan.py `defers_buffers`), a second decoder layer's
    worth of gathered bytes while a checkpointed layer runs: in forward the layer's all-gather buffer,
    kept until the next layer's copy-out; in backward the next layer's all-gather, prefetched while
    this one recomputes and runs its backward."""
    if when == "forward":
        what = "the layer's all-gather buffer, kept for the next copy-out"
    else:
        what = "the next layer's all-gather, prefetched"
    return what, ctx.shards.unit_numel * ctx.cb if defers_buffers(ctx) else 0


def _recompute(
    ctx: RankContext, start: PhaseBill, end: PhaseBill, adapter: AdapterTerm, grads: GradTerm, acts: ActTerm
) -> PhaseBill:
    """Checkpointing: the top checkpointed layer is recomputed while every checkpointed layer's kept
    input still exists. Layers above it (not checkpointed) have run their backward: their saved
    tensors are released and their gradients formed."""
    top = ctx.layers[ctx.ckpt.layers - 1]
    if ctx.ckpt.layers == len(ctx.layers):  # every layer of the stage: only the head's gradient exists yet
        gradients = Bytes(grads.live_fwd, ("the head's gradient", grads.head if ctx.full and ctx.last else 0))
    elif ctx.full and not ctx.persistent_grads:  # all but those of the layers below, `top` included
        unformed = ctx.tensors.numel(("below", top + 1), ctx.tp, ctx.shards.g) * ctx.prec.grad_bytes
        gradients = Bytes(grads.nbytes, ("less those of the layers below, not yet formed", -unformed))
    else:
        gradients = grads.live_fwd
    copies = start["weight_copies"]
    if ctx.autocast and ctx.full and not ctx.shards.fsdp:  # the recomputed layer's casts, made again
        kept = casts_kept_by_checkpointing(ctx, top, plain_layers=False)
        copies = Bytes(("autocast's copies outside the checkpoints, and the recomputed layer's made again", kept))
    return end.with_(
        gradients=gradients,
        adapter=adapter.recomputing + (adapter.grads if ctx.persistent_grads else 0),
        weight_copies=Bytes(copies, _fsdp_buffer(ctx, "backward")),
        activations=Bytes(
            (
                "the recomputed layer's backward: its saved tensors, the MLP's intermediate gradients and the "
                "residual's gradient",
                acts.first_layer_bwd,
            ),
            acts.recompute_inputs,
            ("what the checkpointed layers below keep", ctx.in_flight * (ctx.ckpt.layers - 1) * acts.kept_on_device),
        ),
    )


def checkpointed_layer_forward(ctx: RankContext) -> Bytes:
    """The widest moment inside a checkpointed layer's forward, beyond its kept input. It runs without
    grad, so nothing is saved and each temporary is freed once used; at the MLP's product (act(gate)
    * up) these are alive: the residual after attention, the MLP's normed input, the MLP's
    intermediates, and under eager attention the attention weights the layer's forward still binds
    (`hidden_states, _ = self.self_attn(...)`). Not modelled: MoE blocks and selective checkpointing
    (their forward saves)."""
    spec, act = ctx.spec, ctx.act
    if not ctx.ckpt.layers or ctx.ckpt.selective or spec.mlp.num_experts:
        return Bytes()
    t, h, cb = ctx.tokens, spec.hidden_size, ctx.cb
    heads = spec.num_heads // ctx.tp
    n_inter = 3 if spec.mlp.kind == "gated" else 2  # act(gate), up, their product; or fc, act(fc)
    weights = 0
    if act.attention == "eager":  # softmax in fp32, cast back to the query's dtype (fp32 under autocast)
        weights = ctx.batch.micro_batch_size * heads * ctx.batch.seq_len**2 * (4 if ctx.autocast else cb)
    mlp = Bytes(
        ("the residual after attention and the MLP's normed input", 2 * t * h * ctx.residual),
        ("the MLP's intermediates", n_inter * ctx.mlp_tokens * ctx.inter * cb),
        ("the tiled MLP's output, written a tile at a time", t * h * cb if act.mlp_in_tiles else 0),
        ("eager attention's weights, still bound by the layer's forward", weights),
    )
    return mlp
