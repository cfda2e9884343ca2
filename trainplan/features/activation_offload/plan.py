"""memory.offload_activations in the plan: what the layers save moves to the host (plan/terms.py
`activations` bills what stays and what moves; plan/offload.py `host_ledger` the host), and forward's peak
may come before its end, while the top layer forms."""

from __future__ import annotations

from trainplan.plan import activations as A
from trainplan.plan.context import RankContext
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill, StepBill
from trainplan.plan.terms import RankTerms


def adjust(ctx: RankContext, bill: StepBill, terms: RankTerms) -> StepBill:
    """On a GPU: forward's bill at the end of forward (the layers' saved tensors on the host, the loss's
    buffers on the device), or, if it holds more, the moment the top layer forms, its saved tensors still
    on the device and no loss buffer yet."""
    acts = terms.acts
    if not acts.layer_on_device:  # off, or on the CPU, where the host is the device
        return bill
    forward = PhaseBill(bill.phases["forward"])
    forming = forward.with_(
        logits_loss=0,
        activations=forward["activations"]
        + Bytes(
            ("the top layer's saved tensors, on the device while it forms", acts.layer_on_device),
            ("less the head's, not yet saved", -ctx.in_flight * A.total(acts.head_saved)),
        ),
    )
    return bill.with_phase("forward", max(forward, forming, key=lambda c: c.total))
