"""The backward peak of one rank's analytic bill: the moments of backward that can hold the most
(its start, its end, the top layer's MLP backward, the final norm's backward). Imports no torch.
"""

from __future__ import annotations

from trainplan.plan import activations as A
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill
from trainplan.plan.tensors import _lora_shapes, _numel, _tp_numel
from trainplan.plan.terms import (
    ActTerm,
    AdapterTerm,
    CommTerm,
    GradTerm,
    RankContext,
    autocast_cast_numel,
    in_backward,
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
        root = (
            "the root unit gathered again as backward starts: its all-gather buffer and its parameters",
            2 * ctx.shards.root_numel * ctx.cb,
        )
        if ctx.fused or not ctx.last:
            candidates.append(start.with_(weight_copies=Bytes(root)))
        else:  # the unfused loss returns the loss from the model: the gather runs before the loss's backward,
            # beside what its forward saved (the log-softmax output), not its three backward buffers
            saved = ("the log-softmax output (fp32), saved for backward", ctx.tokens * ctx.spec.vocab_size * 4)
            candidates.append(start.with_(weight_copies=Bytes(root), logits_loss=Bytes(saved)))
    if ctx.fused and ctx.layers and ctx.ckpt.layers < len(ctx.layers):  # the top layer is not checkpointed
        top_layer = _top_layer_mlp_backward(ctx, start, end, adapter, grads, acts)
        candidates += [top_layer, _final_norm_backward(ctx, start, top_layer, adapter, grads, acts)]
    elif not ctx.last and ctx.layers and ctx.ckpt.layers < len(ctx.layers):  # a pipeline stage before the last:
        # no logits buffers either, its backward starts at its top layer's MLP
        candidates.append(_top_layer_mlp_backward(ctx, start, end, adapter, grads, acts))
    return candidates  # checkpointing's recompute: features/checkpointing/plan.py


def _backward_end(
    ctx: RankContext, start: PhaseBill, adapter: AdapterTerm, grads: GradTerm, acts: ActTerm, comm: CommTerm
) -> PhaseBill:
    # The end of backward: the first layer's backward runs while every later gradient exists.
    # autocast's weight copies are released layer by layer as backward consumes them
    end_copies = start["weight_copies"]
    if ctx.autocast and ctx.full and not ctx.shards.fsdp and ctx.layers:
        first = autocast_cast_numel(ctx, "cast_in_layer", ctx.layers[0]) * ctx.cb
        end_copies = Bytes(("autocast's copies of the first layer's weights, the last its backward uses", first))
    comm_end = comm.end
    if ctx.shards.fsdp and ctx.full and ctx.last and ctx.head is not None:
        # FSDP2 reduce-scatters the root unit's gradients in its final callback, after the whole
        # backward: the head's unsharded gradient (compute dtype) is still there at the end.
        comm_end += Bytes(
            ("the head's unsharded gradient, reduce-scattered after the whole backward", ctx.head.numel * ctx.cb)
        )
    return PhaseBill(  # the loss's buffers are gone: a moment of its own, not a delta from the start
        weights=start["weights"],
        weight_copies=end_copies,
        adapter=Bytes(
            adapter.recomputing if ctx.ckpt.layers else adapter.backward_live,
            adapter.grads,
            ("less the first layer's attention adapters', not yet formed", -_first_attention_grads(ctx)),
        ),
        gradients=_all_but_first_layer(grads),
        optimizer=start["optimizer"],
        activations=Bytes((FIRST_LAYER_BWD, acts.first_layer_bwd), acts.end_inputs),
        buffers=start["buffers"],
        comm_buffers=comm_end,
    )


FIRST_LAYER_BWD = (
    "the first layer's backward: its saved tensors, the MLP's intermediate gradients and the residual's gradient"
)


def _all_but_first_layer(grads: GradTerm) -> int:
    """Every gradient but the first layer's (and an untied embedding's), still to come; all of them where
    they persist."""
    if grads.live_fwd >= grads.nbytes - grads.first_layer:
        return grads.live_fwd
    return Bytes(grads.nbytes, ("less the first layer's, not yet formed", -grads.first_layer))


def _fsdp_root_reduce(ctx: RankContext, start: PhaseBill, grads: GradTerm, acts: ActTerm) -> PhaseBill:
    """FSDP2's final callback reduce-scatters the root unit (embedding, final norm, head) after the
    whole backward: its parameters are resharded, its unsharded gradients (compute dtype) are
    copied into one reduce-scatter input of the whole unit in the reduce dtype, and both exist at
    once (measured on the trace: Llama-3.1-8B, 8 ranks, 6.3 GB). With checkpointing, or wherever
    the vocabulary is large beside a layer, this moment is the backward peak."""
    root_shard = ctx.shards.root_numel * ctx.prec.grad_bytes // ctx.shards.g
    unfused = {} if ctx.fused else {"logits_loss": 0}  # the unfused loss's buffers went with its backward
    return start.with_(
        **unfused,
        weight_copies=0,
        gradients=Bytes(
            grads.nbytes, ("less the root unit's shard, not yet reduced", -root_shard * (not ctx.persistent_grads))
        ),
        activations=acts.inputs,
        comm_buffers=Bytes(
            ("the root unit's unsharded gradients", ctx.shards.root_numel * ctx.cb),
            ("and their reduce-scatter input", ctx.shards.root_numel * ctx.prec.grad_bytes),
        ),
    )


def _embedding_backward(ctx: RankContext, end: PhaseBill, grads: GradTerm, acts: ActTerm) -> PhaseBill | None:
    """The embedding's backward, the last of all: every other gradient exists, and
    embedding_dense_backward forms a vocab x hidden gradient. Tied to the head, the head's gradient
    waits in autograd's input buffer for it, and autograd adds the embedding's into the head's in
    place (engine.cpp's InputBuffer accumulate: the engine holds the head's only reference): 2 vocab x
    hidden tensors at once, measured by the profiler with no dispatch mode. (Under a Python dispatch
    mode the sum would be a third tensor; the tracker does it in place, as an unmeasured run does.)
    Where the vocabulary is large beside a layer (SmolLM2: 28M of 135M parameters), this moment is the
    backward peak."""
    emb = ctx.tensors.select("embedding")
    if not emb or not (ctx.full and ctx.first) or ctx.shards.fsdp or ctx.shards.g > 1:
        return None
    emb = emb[0]
    formed = _tp_numel(emb, ctx.tp) * ctx.prec.grad_bytes
    tied = ctx.spec.tie_word_embeddings
    waiting = (
        "the head's gradient waiting for the tied embedding's, and the embedding's, summed into the head's",
        2 * formed * tied,
    )
    return end.with_(
        weight_copies=0,  # every layer's backward has consumed its casts
        gradients=Bytes(
            grads.nbytes, ("less the tied embedding's, counted below", -formed * (tied and not ctx.persistent_grads))
        ),
        activations=Bytes(
            acts.inputs,
            waiting,
            ("the embedding's gradient formed beside the bucket's", formed * (ctx.persistent_grads and not tied)),
        ),
    )


def _micro(ctx: RankContext) -> str:
    return f", x {ctx.in_flight} micro-batches in flight" if ctx.in_flight > 1 else ""


def _top_layer_mlp_backward(
    ctx: RankContext, start: PhaseBill, end: PhaseBill, adapter: AdapterTerm, grads: GradTerm, acts: ActTerm
) -> PhaseBill:
    # Without the logits buffers, the top layer's MLP backward can be the peak: every layer's
    # saved tensors, the MLP's intermediate gradients, and the gradients formed so far (head,
    # final norm, the top layer's down projection).
    cb, tokens, inter = ctx.cb, ctx.tokens, ctx.inter
    formed = ctx.tensors.numel("top_down", ctx.tp, ctx.shards.g) if ctx.full else 0  # final norm, top down_proj
    formed_bytes = formed * ctx.prec.grad_bytes
    top_down_in = tokens * inter * cb if ctx.full and not ctx.act.mlp_in_tiles else 0  # tiled: never saved
    head_and_top = Bytes(
        ("the head's gradient", grads.head), ("the final norm's and the top down projection's", formed_bytes)
    )
    gradients = grads.live_fwd if ctx.persistent_grads and ctx.full else head_and_top
    comm = start["comm_buffers"]  # no unit has finished its backward yet
    if ctx.shards.fsdp and ctx.full:  # gradients unsharded, in the compute dtype, till their reduce-scatter
        gradients = 0
        unsharded = ((ctx.head.numel if ctx.head is not None else 0) + ctx.tensors.numel("top_down", 1)) * cb
        comm += Bytes(("the head's, final norm's and top down projection's unsharded gradients", unsharded))
    copies = start["weight_copies"]
    if ctx.dims.reshard_after_forward and len(ctx.layers) > 1:
        copies += Bytes(("the next unit, prefetched", ctx.shards.unit_numel * cb))
    saved = Bytes(
        (f"every layer's saved tensors{_micro(ctx)}", ctx.in_flight * acts.saved_layers),
        acts.inputs,
        ("the top layer's saved tensors, back on the device (offloaded)", acts.layer_on_device),
        ("the residual stream's gradient", acts.layer_in),
    )
    activations = Bytes(
        saved,
        ("less the top down projection's input, released by its backward", -top_down_in),
        ("the MLP's intermediate gradients (d product, d act, d up)", 3 * ctx.mlp_tokens * inter * cb),
        ("the tiled MLP's recompute of one tile and its input's gradient", ctx.mlp_tile_backward),
    )
    if ctx.spec.mlp.num_experts:  # the MoE block's own widest moment (no down_proj module: `formed` holds norms only)
        released, temps, expert_grad = moe_backward(ctx)
        activations = Bytes(
            saved,
            ("less what the MoE block's backward has released", -released),
            ("the MoE block's backward temporaries at its widest", temps),
        )
        gradients += Bytes(("the expert down projection's gradient", expert_grad))
    return end.with_(
        gradients=gradients,
        adapter=adapter.backward_live + (adapter.grads if ctx.persistent_grads else 0),
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
    # fp32 (tokens x hidden) temporaries, 2 when the residual stream is fp32 (3 under autocast, whose
    # head hands back a gradient cast up from the compute dtype) and 4 when it is upcast or under LoRA
    # (counted on the trace, transformers 5.24's LlamaRMSNorm).
    temps = 4 if (ctx.residual != 4 or not ctx.full) else (3 if ctx.autocast else 2)
    gradients = grads.live_fwd if ctx.persistent_grads and ctx.full else Bytes(("the head's gradient", grads.head))
    comm = start["comm_buffers"]
    if ctx.shards.fsdp and ctx.full:
        gradients = 0
        comm += Bytes(("the head's unsharded gradient", ctx.head.numel * ctx.cb))
    norm_bwd = top_layer.with_(
        gradients=gradients,
        weight_copies=start["weight_copies"],
        comm_buffers=comm,
        activations=Bytes(
            (f"every layer's saved tensors{_micro(ctx)}", ctx.in_flight * acts.saved_layers),
            acts.inputs,
            ("the final norm's and the head's saved tensors", A.total(acts.head_saved)),
            ("the hidden state's gradient", ctx.tokens * ctx.spec.hidden_size * ctx.residual),
            (f"the norm's {temps} fp32 temporaries", ctx.tokens * ctx.spec.hidden_size * temps * 4),
        ),
    )
    if not ctx.full and not ctx.persistent_grads:
        one = ("one layer's adapter gradients", adapter.grads // len(ctx.layers))
        norm_bwd = norm_bwd.with_(adapter=adapter.backward_live + Bytes(one))
    return norm_bwd


def _first_attention_grads(ctx: RankContext) -> int:
    """The gradients of the adapters on the stage's first layer's attention linears (none kept
    when the optimizer steps in backward)."""
    if not ctx.adapters.on or not ctx.layers or in_backward(ctx):
        return 0
    r, targets, tp = ctx.cfg.lora.r, ctx.adapters.targets, ctx.tp

    def numel() -> int:
        attention = targets & frozenset(lin.module for lin in ctx.spec.layer_linears if lin.group == "attn")
        return sum(_numel(s) for s in _lora_shapes(ctx.spec, r, attention, range(1), tp))

    return ctx.tensors.memo(("first layer's attention adapters", r, targets, tp), numel) * 4 // ctx.shards.g
