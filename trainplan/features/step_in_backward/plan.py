"""optim.step_in_backward in the plan: no moment of backward holds more than one tensor's gradient, each
update's temporaries sit beside it, and there is no optimizer phase (the updates ran in backward)."""

from __future__ import annotations

from trainplan.features import step_in_backward
from trainplan.plan.context import RankContext
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill, StepBill
from trainplan.plan.tensors import _tp_numel
from trainplan.plan.terms import ActTerm, GradTerm, RankTerms, optimizer


def adjust(ctx: RankContext, bill: StepBill, terms: RankTerms) -> StepBill:
    if not step_in_backward.on(ctx.cfg):
        return bill
    moments = _moments(ctx, bill.moments, terms.grads, terms.acts)
    return StepBill(phases=bill.phases, moments=moments).without_phase("optimizer")


def _moments(
    ctx: RankContext, candidates: tuple[PhaseBill, ...], grads: GradTerm, acts: ActTerm
) -> tuple[PhaseBill, ...]:
    """optim.step_in_backward: no moment holds more than one tensor's gradient (`grads` holds the
    largest's), and each update's temporaries (a single tensor's: linear in its size) exist beside
    its gradient. The largest tensor's update is counted at backward's end: for the embedding, the
    last gradient formed, after every layer has released its saved tensors. An untied head's update
    comes first, while every layer's saved tensors still exist; a tied one's waits for the embedding's."""
    tied_head = grads.head if ctx.spec.tie_word_embeddings else 0

    def one_gradient(moment: PhaseBill) -> PhaseBill:
        gradients = max(0, min(moment["gradients"], grads.nbytes))
        # a tied head's gradient is no parameter's .grad until the embedding's backward adds to it: it
        # waits in autograd's input buffer, where the gradients' update has not freed it
        waiting = min(gradients, tied_head)
        return moment.with_(
            gradients=Bytes(gradients, ("less the tied head's, counted under activations", -waiting)),
            activations=moment["activations"]
            + Bytes(("the tied head's gradient, in autograd's input buffer", waiting)),
        )

    candidates = [one_gradient(m) for m in candidates]
    start, end = candidates[0], candidates[1]
    temp = optimizer(ctx).temp
    last = end.with_(gradients=grads.nbytes, optimizer_temp=temp)
    embedding = ctx.tensors.select("embedding")
    if ctx.full and ctx.first and embedding and _tp_numel(embedding[0], ctx.tp) == ctx.tensors.largest("held", ctx.tp):
        last = last.with_(activations=acts.inputs, weight_copies=0)
    steps = [last]
    if ctx.full and ctx.last and ctx.head is not None and not ctx.spec.tie_word_embeddings and grads.nbytes:
        head_grad = _tp_numel(ctx.head, ctx.tp) * ctx.prec.grad_bytes
        steps.append(
            start.with_(
                gradients=Bytes(("the head's gradient, updated first", head_grad)),
                optimizer_temp=Bytes(("the head's update's temporaries", temp * head_grad // grads.nbytes)),
            )
        )
    # first: the embedding's update holds as much as its backward did (its gradient and two
    # temporaries for the head's, the embedding's and their sum), and a tie goes to the first listed
    return (candidates[0], *steps, *candidates[1:])
