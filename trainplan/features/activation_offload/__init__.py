"""memory.offload_activations: the saved tensors of the decoder layers that are not checkpointed go
to host memory in forward and come back for backward (its engine.py's hooks), pageable or pinned."""

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
    if on(cfg) and cfg.memory.activation_checkpointing is True:
        raise ConfigError(
            "memory.offload_activations",
            "every layer is checkpointed (memory.activation_checkpointing = true): no layer is left to offload",
            'checkpoint fewer layers (a number, or "auto") or set memory.offload_activations = false',
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
