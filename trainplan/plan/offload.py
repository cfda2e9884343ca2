"""The offloads' plan: what parallel.offload_optimizer moves off the device (FSDP2's CPUOffloadPolicy as
the engine runs it, or DeepSpeed's ZeRO-Offload, planned), forward's moment under
memory.offload_activations (its saved-tensor terms are plan/terms.py `activations`), and the host's
bill of every rank's offloaded optimizer and activations."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from trainplan import config as C
from trainplan import features
from trainplan.plan import activations as A
from trainplan.plan import terms as T
from trainplan.plan.ledger import DeviceLedger
from trainplan.plan.phase import PhaseBill
from trainplan.spec.devices import DeviceSpec, host_memory_bytes, parse_size


def how(ctx: T.RankContext) -> str:
    """How parallel.offload_optimizer runs on the rank (features/optimizer_offload `how`)."""
    return features.optimizer_offload.how(ctx.r, cpu=ctx.cpu)


def optimizer_on_host(
    ctx: T.RankContext, grads: T.GradTerm, opt: T.OptTerm, adapter: T.AdapterTerm, explain: dict[str, str]
) -> tuple[int, T.OptTerm, T.AdapterTerm]:
    """(host bytes, the optimizer and adapter terms left on the device) under parallel.offload_optimizer;
    the explanations of what moved are set in `explain`."""
    host_bytes = 0
    offload = how(ctx)
    if offload == "zero-offload":  # states, step temporaries and a gradient copy move to the host
        host_bytes = opt.states + opt.temp + grads.nbytes + adapter.states
        explain["optimizer"] = "offloaded to host memory (see the host column)"
        opt, adapter = opt._replace(states=0, temp=0), adapter._replace(states=0)
    elif offload == "fsdp2":
        # the step runs on the host's tensors, with the host's optimizer implementation
        host_opt = T.optimizer(dataclasses.replace(ctx, cpu=True))
        pinned_weights, pinned_grads = T.pinned_fsdp_shards(ctx)
        if T.in_backward(ctx):  # a gradient hook reads each gradient at once: FSDP2 copies it pageable
            pinned_grads = grads.nbytes + adapter.grads
        host_bytes = pinned_weights + pinned_grads + host_opt.states + host_opt.temp + adapter.states
        for key in ("weights", "gradients", "optimizer", "optimizer_temp"):
            explain[key] = "this rank's shard is in host memory (FSDP2 CPUOffloadPolicy; see the host column)"
    elif offload == "none on the CPU":
        explain["optimizer"] = (
            explain.get("optimizer", "") + " (parallel.offload_optimizer: on the CPU the host is the device, so "
            "FSDP2's offload moves nothing)"
        ).lstrip()
    return host_bytes, opt, adapter


def on_device_under_fsdp2(
    ctx: T.RankContext, phase: Mapping[str, int], adapter: T.AdapterTerm, head_grad: int
) -> PhaseBill:
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
        out = out.plus(weight_copies=-(-ctx.shards.unit_numel // ctx.shards.w) * ctx.prec.param_bytes)
    return out


def forward_under_activation_offload(ctx: T.RankContext, forward: PhaseBill, acts: T.ActTerm) -> PhaseBill:
    """memory.offload_activations on a GPU: forward's bill at the end of forward (the layers' saved
    tensors on the host, the loss's buffers on the device), or, if it holds more, the moment the top
    layer forms, its saved tensors still on the device and no loss buffer yet."""
    forming = forward.with_(logits_loss=0).plus(
        activations=acts.layer_on_device - ctx.in_flight * A.total(acts.head_saved)
    )
    return max(forward, forming, key=lambda c: c.total)


def host_ledger(cfg: C.RunConfig, ledgers: list[DeviceLedger], *, fsdp2: bool) -> DeviceLedger:
    """Host memory under offload: what every rank on the node keeps there. The offloaded activations
    are there at the end of forward (backward releases them layer by layer) beside the optimizer's
    bytes, which include the step's temporaries: their sum bounds the host's peak from above."""
    host_cap = parse_size(cfg.hardware.host_mem, "hardware.host_mem") if cfg.hardware.host_mem else host_memory_bytes()
    host_dev = DeviceSpec(name="host RAM", kind="cpu", capacity_bytes=host_cap, bf16=True, peak_tflops=None)
    offloaded = sum(led.offload_bytes for led in ledgers)
    activations = sum(led.host_activation_bytes for led in ledgers)
    explain = {}
    if offloaded:
        explain["optimizer"] = (
            "the parameter shards and their gradients (page-locked, each rounded up to a power of two; gradients "
            "pageable under optim.step_in_backward), optimizer states and step temporaries of every rank on this "
            "node (FSDP2 CPUOffloadPolicy)"
            if fsdp2
            else "optimizer states, their step temporaries and a gradient copy of every rank on this node"
        )
    if activations:
        pinned = (
            " in page-locked buffers, each rounded up to a power of two"
            if features.activation_offload.kind(cfg) == "pinned"
            else ""
        )
        explain["activations"] = (
            f"the saved tensors of the layers not checkpointed, every rank's on this node{pinned} "
            "(memory.offload_activations)"
        )
    roles = [what for what, n in (("optimizer", offloaded), ("activations", activations)) if n]
    return DeviceLedger(
        label="host",
        device=host_dev,
        role=f"offloaded {' and '.join(roles)} (all ranks)",
        phases={
            "forward" if activations else "optimizer": {
                k: v for k, v in (("optimizer", offloaded), ("activations", activations)) if v
            }
        },
        runtime_bytes=0,
        reserve_fraction=0.0,
        explain=explain,
    )
