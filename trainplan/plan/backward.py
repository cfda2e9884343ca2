"""The backward peak of one rank's analytic bill: the moments of backward that can hold the most
(its start, its end, the top layer's MLP backward, the final norm's backward). Imports no torch.
"""

from __future__ import annotations

from trainplan.plan import activations as A
from trainplan.plan.phase import PhaseBill
from trainplan.plan.tensors import _tp_numel
from trainplan.plan.terms import (
    ActTerm,
    AdapterTerm,
    CommTerm,
    GradTerm,
    RankContext,
    autocast_cast_numel,
    moe_backward,
)

# ---- the backward peak -----------------------------------------------------------------------


def backward_moments(
    ctx: RankContext, start: PhaseBill, adapter: AdapterTerm, grads: GradTerm, acts: ActTerm, comm: CommTerm
) -> list[PhaseBill]:
    """The moments of backward that can be its peak, `start` (the start of backward) first, each a
    delta from `start` or from another moment; the plan takes whichever holds the most."""
    end = _backward_end(ctx, start, adapter, grads, acts, comm)
    candidates = [start, end]
    embedding = _embedding_backward(ctx, end, grads, acts)
    if embedding is not None:
        candidates.append(embedding)
    if ctx.shards.fsdp and ctx.full and ctx.shards.root_numel:
        candidates.append(_fsdp_root_reduce(ctx, start, grads, acts))
    if ctx.dims.reshard_after_forward:
        # The root unit is resharded after forward and gathered again as backward starts: its
        # all-gather output buffer and the unsharded parameters exist together for a moment.
        candidates.append(start.with_(weight_copies=2 * ctx.shards.root_numel * ctx.cb))
    if ctx.fused and ctx.layers and ctx.ckpt.layers < len(ctx.layers):  # the top layer is not checkpointed
        top_layer = _top_layer_mlp_backward(ctx, start, end, adapter, grads, acts)
        candidates += [top_layer, _final_norm_backward(ctx, start, top_layer, adapter, grads, acts)]
    return candidates  # checkpointing's recompute: features/checkpointing/plan.py


def _backward_end(
    ctx: RankContext, start: PhaseBill, adapter: AdapterTerm, grads: GradTerm, acts: ActTerm, comm: CommTerm
) -> PhaseBill:
    # The end of backward: the first layer's backward runs while every later gradient exists.
    # autocast's weight copies are released layer by layer as backward consumes them
    end_copies = start["weight_copies"]
    if ctx.autocast and ctx.full and not ctx.shards.fsdp and ctx.layers:
        end_copies = autocast_cast_numel(ctx, "cast_in_layer", ctx.layers[0]) * ctx.cb
    comm_end = comm.end
    if ctx.shards.fsdp and ctx.full and ctx.last and ctx.head is not None:
        # FSDP2 reduce-scatters the root unit's gradients in its final callback, after the whole
        # backward: the head's unsharded gradient (compute dtype) is still there at the end.
        comm_end += ctx.head.numel * ctx.cb
    return PhaseBill(  # the loss's buffers are gone: a moment of its own, not a delta from the start
        weights=start["weights"],
        weight_copies=end_copies,
        adapter=adapter.live + adapter.grads,
        gradients=max(grads.live_fwd, grads.nbytes - grads.first_layer),
        optimizer=start["optimizer"],
        activations=acts.first_layer_bwd + ctx.in_flight * acts.step_inputs,
        buffers=start["buffers"],
        comm_buffers=comm_end,
    )


def _fsdp_root_reduce(ctx: RankContext, start: PhaseBill, grads: GradTerm, acts: ActTerm) -> PhaseBill:
    """FSDP2's final callback reduce-scatters the root unit (embedding, final norm, head) after the
    whole backward: its parameters are resharded, its unsharded gradients (compute dtype) are
    copied into one reduce-scatter input of the whole unit in the reduce dtype, and both exist at
    once (measured on the trace: Llama-3.1-8B, 8 ranks, 6.3 GB). With checkpointing, or wherever
    the vocabulary is large beside a layer, this moment is the backward peak."""
    root_shard = ctx.shards.root_numel * ctx.prec.grad_bytes // ctx.shards.g
    return start.with_(
        weight_copies=0,
        gradients=grads.nbytes - (0 if ctx.persistent_grads else root_shard),
        activations=ctx.in_flight * acts.step_inputs,
        comm_buffers=ctx.shards.root_numel * (ctx.cb + ctx.prec.grad_bytes),
    )


def _embedding_backward(ctx: RankContext, end: PhaseBill, grads: GradTerm, acts: ActTerm) -> PhaseBill | None:
    """The embedding's backward, the last of all: every other gradient exists, and
    embedding_dense_backward forms a vocab x hidden gradient. Tied to the head, the head's gradient
    waits in autograd's input buffer for it and the two are summed into a third (measured on the
    trace: 3 vocab x hidden tensors at once). Where the vocabulary is large beside a layer
    (SmolLM2: 28M of 135M parameters), this moment is the backward peak."""
    emb = ctx.tensors.select("embedding")
    if not emb or not (ctx.full and ctx.first) or ctx.shards.fsdp or ctx.shards.g > 1:
        return None
    emb = emb[0]
    formed = _tp_numel(emb, ctx.tp) * ctx.prec.grad_bytes
    tied = ctx.spec.tie_word_embeddings
    in_buffers = (3 * formed if tied else 0) + (formed if ctx.persistent_grads and not tied else 0)
    return end.with_(
        weight_copies=0,  # every layer's backward has consumed its casts
        gradients=grads.nbytes - (formed if tied and not ctx.persistent_grads else 0),
        activations=ctx.in_flight * acts.step_inputs + in_buffers,
    )


def _top_layer_mlp_backward(
    ctx: RankContext, start: PhaseBill, end: PhaseBill, adapter: AdapterTerm, grads: GradTerm, acts: ActTerm
) -> PhaseBill:
    # Without the logits buffers, the top layer's MLP backward can be the peak: every layer's
    # saved tensors, the MLP's intermediate gradients, and the gradients formed so far (head,
    # final norm, the top layer's down projection).
    cb, tokens, inter = ctx.cb, ctx.tokens, ctx.inter
    formed = ctx.tensors.numel("top_down", ctx.tp, ctx.shards.g) if ctx.full else 0  # final norm, top down_proj
    formed_bytes = formed * ctx.prec.grad_bytes
    top_down_in = tokens * inter * cb if ctx.full else 0
    gradients = grads.live_fwd if ctx.persistent_grads and ctx.full else grads.head + formed_bytes
    comm = start["comm_buffers"]  # no unit has finished its backward yet
    if ctx.shards.fsdp and ctx.full:  # gradients unsharded, in the compute dtype, till their reduce-scatter
        gradients = 0
        comm += (ctx.head.numel + ctx.tensors.numel("top_down", 1)) * cb  # unsharded
    copies = start["weight_copies"]
    if ctx.dims.reshard_after_forward and len(ctx.layers) > 1:
        copies += ctx.shards.unit_numel * cb  # the next unit, prefetched
    activations = (
        ctx.in_flight * (acts.saved_layers + acts.step_inputs)
        + acts.layer_on_device  # offloaded: the top layer's saved tensors, back on the device
        - top_down_in
        + 3 * tokens * inter * cb
        + acts.layer_in
    )
    if ctx.spec.mlp.num_experts:  # the MoE block's own widest moment (no down_proj module: `formed` holds norms only)
        released, temps, expert_grad = moe_backward(ctx)
        activations = ctx.in_flight * (acts.saved_layers + acts.step_inputs) - released + temps
        activations += acts.layer_in + acts.layer_on_device
        gradients += expert_grad
    return end.with_(
        gradients=gradients,
        adapter=adapter.live + (adapter.grads if ctx.persistent_grads else 0),
        weight_copies=copies,
        comm_buffers=comm,
        activations=activations,
    )


def _final_norm_backward(
    ctx: RankContext,
    start: PhaseBill,
    top_layer: PhaseBill,
    adapter: AdapterTerm,
    grads: GradTerm,
    acts: ActTerm,
) -> PhaseBill:
    # An RMSNorm's backward: the final norm's (under LoRA, the top layer's input norm, after
    # that layer's adapter gradients): every layer's saved tensors, dL/dhidden and the norm's
    # fp32 (tokens x hidden) temporaries, 2 when the residual stream is fp32 and 4 when it is
    # upcast or under LoRA (counted on the trace, transformers 5.24's LlamaRMSNorm).
    temps = 4 if (ctx.residual != 4 or not ctx.full) else 2
    gradients = grads.live_fwd if ctx.persistent_grads and ctx.full else grads.head
    comm = start["comm_buffers"]
    if ctx.shards.fsdp and ctx.full:
        gradients = 0
        comm += ctx.head.numel * ctx.cb
    norm_bwd = top_layer.with_(
        gradients=gradients,
        weight_copies=start["weight_copies"],
        comm_buffers=comm,
        activations=ctx.in_flight * (acts.saved_layers + acts.step_inputs)
        + A.total(acts.head_saved)
        + ctx.tokens * ctx.spec.hidden_size * (ctx.residual + temps * 4),
    )
    if not ctx.full and not ctx.persistent_grads:
        norm_bwd = norm_bwd.with_(adapter=adapter.live + adapter.grads // len(ctx.layers))
    return norm_bwd
