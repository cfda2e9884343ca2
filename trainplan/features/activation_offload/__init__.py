"""memory.offload_activations: what the decoder layers keep for backward goes to host memory in forward and
comes back for backward (its engine.py's hooks), pageable or pinned: the saved tensors of the layers not
checkpointed, and the checkpointed layers' inputs (ALST's checkpoints in host memory), each back for its
layer's recompute."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def on(cfg: RunConfig) -> bool:
    return bool(cfg.memory.offload_activations)


def kind(cfg: RunConfig) -> str:
    """How the hooks hold what they move while training: "" (off), "pageable" or "pinned"."""
    if cfg.mode == "inference":
        return ""
    return {False: "", True: "pageable", "pinned": "pinned"}[cfg.memory.offload_activations]


def refuse(r: Resolved) -> None:
    cfg = r.cfg
    if on(cfg) and cfg.mode == "inference":
        raise ConfigError(
            "memory.offload_activations",
            "inference saves no activations for a backward",
            "set memory.offload_activations = false",
        )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """The engine offloads on one device or many, under every strategy."""


def untraceable(r: Resolved) -> str | None:
    if on(r.cfg) and r.devices[0].is_gpu:
        return (
            "memory.offload_activations: the trace runs on one fake device and cannot tell host from GPU memory; "
            "use `trainplan plan` (analytic), or `trainplan accept` to measure the run"
        )
    return None
