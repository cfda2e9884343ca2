"""The host's bill under the offloads: every rank's offloaded optimizer (features/optimizer_offload/plan.py)
and activations (features/activation_offload/plan.py, plan/terms.py `activations`)."""

from __future__ import annotations

from trainplan import config as C
from trainplan import features
from trainplan.plan.ledger import DeviceLedger
from trainplan.plan.parts import Bytes
from trainplan.spec.devices import DeviceSpec, host_memory_bytes, parse_size


def host_ledger(cfg: C.RunConfig, ledgers: list[DeviceLedger], *, fsdp2: bool) -> DeviceLedger:
    """Host memory under offload: what every rank on the node keeps there. The offloaded activations
    are there at the end of forward (backward releases them layer by layer) beside the optimizer's
    bytes, which include the step's temporaries: their sum bounds the host's peak from above."""
    host_cap = parse_size(cfg.hardware.host_mem, "hardware.host_mem") if cfg.hardware.host_mem else host_memory_bytes()
    host_dev = DeviceSpec(name="host RAM", kind="cpu", capacity_bytes=host_cap, bf16=True, peak_tflops=None)
    offloaded = Bytes(*(led.offload_bytes for led in ledgers)).merged()
    activations = Bytes(("every rank's offloaded saved tensors", sum(led.host_activation_bytes for led in ledgers)))
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
