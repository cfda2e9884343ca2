"""adamw-8bit: bitsandbytes' AdamW8bit (Dettmers et al. 2022), block-wise 8-bit states; its CUDA
kernels, or its CPU backend, on plain tensors, in one process or under DDP."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from trainplan.errors import NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

NAME = "adamw-8bit"


def is_8bit(name: str) -> bool:
    """optim.name (or an advisor rung's optimizer) names the 8-bit optimizer."""
    return name == NAME


def on(cfg: RunConfig) -> bool:
    return is_8bit(cfg.optim.name) and cfg.mode != "inference"


def refuse(r: Resolved) -> None:
    """The planner covers it on every device (the CPU backend's states are 8-bit too)."""


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if not on(cfg):
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise NotRunnable(
            "optim.name",
            "adamw-8bit runs bitsandbytes' AdamW8bit, and bitsandbytes is not installed",
            "pip install -r requirements.txt (it pins bitsandbytes), or use optim.name = adamw",
            what="8-bit AdamW without bitsandbytes",
        )
    if dims.strategy not in ("single", "ddp"):
        raise NotRunnable(
            "parallel.strategy",
            f"adamw-8bit with {dims.strategy} is not run by this engine: bitsandbytes' kernels take whole plain "
            "tensors, not FSDP2's DTensor shards or ZeroRedundancyOptimizer's partitions",
            "use parallel.strategy = ddp, or optim.name = adamw",
            what="sharded 8-bit AdamW",
        )


def untraceable(r: Resolved) -> str | None:
    if is_8bit(r.cfg.optim.name):
        return "optim.name: adamw-8bit needs bitsandbytes on CUDA and cannot be traced; use `trainplan plan` for it"
    return None
