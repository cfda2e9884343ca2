"""FSDP2 in the plan: the forward moment its all-gather buffers make (plan/terms.py `weight_copies` bills
the root unit and one decoder layer gathered).

With reshard_after_forward, FSDP2 copies each unit's all-gather output into the unit's parameters and,
in forward, keeps that flat buffer until the next unit has copied out its own (overlap of the copy-out
with the next all-gather: `FSDPParamGroup.wait_for_unshard`), the previous one still referenced while
that copy runs. So as the first decoder layer is copied out, the root unit is held twice (its
parameters and its buffer) beside the layer's buffer and parameters: with a vocabulary large beside a
layer and no logits yet, the forward's and the held-out forward's peak. Measured: the storage tracker
on 2 gloo ranks equals the fake-tensor trace, which the plan did not (tiny Llama, LoRA, -29 %)."""

from __future__ import annotations

from trainplan.plan.context import RankContext
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill, StepBill
from trainplan.plan.terms import RankTerms


def defers_buffers(ctx: RankContext) -> bool:
    """Does this rank hold FSDP2's all-gather buffers beside the gathered parameters (resharding, over
    more than one rank; one rank's units are copied out of their shards without a buffer)?"""
    return ctx.shards.fsdp and ctx.dims.reshard_after_forward and ctx.dims.dp > 1


def adjust(ctx: RankContext, bill: StepBill, terms: RankTerms) -> StepBill:
    # the root's copy-out opens the forward of the first stage, or of any pipeline stage holding a root:
    # under pp the stage's module is the root (features/sharding/engine.py shard_stage), whose buffer is
    # kept whether the layers reshard or not (measured under zero3 and fsdp-grad-op on 4 gloo ranks)
    staged = ctx.dims.shards_stages and ctx.shards.root_numel > 0
    if not (((defers_buffers(ctx) and ctx.first) or staged) and ctx.layers):
        return bill
    root, layer = ctx.shards.root_numel * ctx.cb, ctx.shards.unit_numel * ctx.cb
    copies = Bytes(
        ("the root unit's parameters and its all-gather buffer, still referenced", 2 * root),
        ("the first decoder layer's all-gather buffer and its parameters, being copied out", 2 * layer),
    )
    embedded = ("the embedding's output", ctx.tokens * ctx.spec.hidden_size * ctx.residual)
    phases = dict(bill.phases)
    forward = phases["forward"]  # inside the last layer's forward: what the layers saved, no logits yet
    kept = ("the layer's all-gather buffer, kept for the next copy-out", layer)
    inside = forward.with_(weight_copies=Bytes(forward["weight_copies"], kept), logits_loss=0)
    if not ctx.ckpt.layers and inside.total > forward.total:  # checkpointing's own moment has the buffer
        phases["forward"] = inside
    for name in ("forward", "evaluate"):
        if name not in phases:
            continue
        phase = phases[name]
        changed = {"weight_copies": copies, "activations": Bytes(terms.acts.inputs, embedded), "logits_loss": 0}
        moment = phase.with_(**changed) if isinstance(phase, PhaseBill) else {**phase, **changed}
        if sum(moment.values()) > sum(phase.values()):
            phases[name] = moment
    return StepBill(phases=phases, moments=bill.moments)


def inference_moment(ctx: RankContext, *, inputs: int, layer: int, hidden: int, logits: int):
    """Inference under FSDP2 with its buffers (`defers_buffers`; plan/lifecycle.py `inference`): the widest
    of its three moments, as (gathered weights, transient, logits). The first layer's copy-out (the
    root unit held twice, the layer's buffer and parameters, the embedding's output); inside a layer
    (the root, the layer's buffer kept for the next copy-out, its parameters, the layer's working
    set); the loss (the root, the last layer's buffer, the final hidden state and the logits)."""
    root, unit = ctx.shards.root_numel * ctx.cb, ctx.shards.unit_numel * ctx.cb
    ids = ("the batch's ids and labels", inputs)
    moments = [
        (
            Bytes(
                ("the root unit and its all-gather buffer", 2 * root),
                ("the first layer's buffer and parameters", 2 * unit),
            ),
            Bytes(ids, ("the embedding's output", hidden)),
            0,
        ),
        (
            Bytes(("the root unit", root), ("a layer's all-gather buffer and parameters", 2 * unit)),
            Bytes(ids, ("the widest layer's working set", layer)),
            0,
        ),
        (
            Bytes(("the root unit", root), ("the last layer's all-gather buffer", unit)),
            Bytes(ids, ("the final hidden state", hidden)),
            logits,
        ),
    ]
    return max(moments, key=lambda m: m[0] + m[1] + m[2])
