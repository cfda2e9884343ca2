"""parallel.offload_optimizer in the plan: what moves off the device (FSDP2's CPUOffloadPolicy as the engine
runs it, or DeepSpeed's ZeRO-Offload, planned), counted for the host (plan/offload.py `host_ledger`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from trainplan.features import optimizer_offload
from trainplan.plan import terms as T
from trainplan.plan.context import RankContext
from trainplan.plan.parts import Bytes
from trainplan.plan.phase import PhaseBill, StepBill


def how(ctx: RankContext) -> str:
    """How parallel.offload_optimizer runs on the rank (features/optimizer_offload `how`)."""
    return optimizer_offload.how(ctx.r, cpu=ctx.cpu)


def on_host(
    ctx: RankContext, grads: T.GradTerm, opt: T.OptTerm, adapter: T.AdapterTerm, explain: dict[str, str]
) -> tuple[int, T.OptTerm, T.AdapterTerm]:
    """(host bytes, the optimizer and adapter terms left on the device); the explanations of what moved
    are set in `explain`."""
    host_bytes = 0
    offload = how(ctx)
    if offload == "zero-offload":  # states, step temporaries and a gradient copy move to the host
        host_bytes = Bytes(
            ("optimizer states", opt.states),
            ("step temporaries", opt.temp),
            ("a gradient copy", grads.nbytes),
            ("the adapters' optimizer states", adapter.states),
        )
        explain["optimizer"] = "offloaded to host memory (see the host column)"
        opt, adapter = opt._replace(states=0, temp=0), adapter._replace(states=0)
    elif offload == "fsdp2":
        # the step runs on the host's tensors, with the host's optimizer implementation
        host_opt = T.optimizer(dataclasses.replace(ctx, cpu=True))
        pinned_weights, pinned_grads = T.pinned_fsdp_shards(ctx)
        if T.in_backward(ctx):  # a gradient hook reads each gradient at once: FSDP2 copies it pageable
            pinned_grads = grads.nbytes + adapter.grads
        host_bytes = Bytes(
            ("parameter shards", pinned_weights),
            ("gradient shards", pinned_grads),
            ("optimizer states", host_opt.states),
            ("step temporaries", host_opt.temp),
            ("the adapters' optimizer states", adapter.states),
        )
        for key in ("weights", "gradients", "optimizer", "optimizer_temp"):
            explain[key] = "this rank's shard is in host memory (FSDP2 CPUOffloadPolicy; see the host column)"
    elif offload == "none on the CPU":
        explain["optimizer"] = (
            explain.get("optimizer", "") + " (parallel.offload_optimizer: on the CPU the host is the device, so "
            "FSDP2's offload moves nothing)"
        ).lstrip()
    return host_bytes, opt, adapter


def adjust(ctx: RankContext, bill: StepBill, terms: T.RankTerms) -> StepBill:
    """Under FSDP2's CPUOffloadPolicy, every phase and moment on the device: see `_on_device`. The head's
    gradient, formed on the device in backward, stays there in backward's moments."""
    if how(ctx) != "fsdp2":
        return bill
    head_grad = terms.loss.by_phase["backward_grads"]
    return StepBill(
        phases={name: _on_device(ctx, phase, terms.adapter, 0) for name, phase in bill.phases.items()},
        moments=tuple(_on_device(ctx, m, terms.adapter, head_grad) for m in bill.moments),
    )


def _on_device(ctx: RankContext, phase: Mapping[str, int], adapter: T.AdapterTerm, head_grad: int) -> PhaseBill:
    """One moment's device bill under FSDP2's CPUOffloadPolicy: the parameter shards, their gradients
    (each reduce-scattered shard is copied to the host) and the optimizer live in host memory; the
    device keeps what is gathered or computed, plus, while a unit is gathered, its shard copied over
    for the all-gather. `head_grad`: the loss's gradient term of the moment (the head's, formed on the
    device and reduce-scattered with the root unit after backward): it stays, where the moment has it."""
    out = PhaseBill(phase).without("weights", "optimizer", "optimizer_temp")
    if "gradients" in out:
        out = out.with_(gradients=min(out["gradients"], head_grad))
    if "adapter" in out:
        out = out.with_(adapter=adapter.copy)
    if out.get("weight_copies"):
        shard = -(-ctx.shards.unit_numel // ctx.shards.w) * ctx.prec.param_bytes
        out = out.plus(weight_copies=("the unit's shard, copied to the device for its all-gather", shard))
    return out
