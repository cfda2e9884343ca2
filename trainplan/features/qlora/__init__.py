"""QLoRA (Dettmers et al. 2023): the frozen base's linear layers in bitsandbytes NF4, LoRA adapters on
top. The planner covers it anywhere; the engine builds it on CUDA, unsharded (its engine.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError, NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

MODE = "qlora"


def on(cfg: RunConfig) -> bool:
    return cfg.mode == MODE


def refuse(r: Resolved) -> None:
    if on(r.cfg) and any(not d.is_gpu for d in r.devices):
        raise ConfigError(
            "run.mode",
            "qlora needs CUDA GPUs (bitsandbytes 4-bit kernels)",
            'plan for GPUs (hardware.gpus) or use mode = "lora" on the CPU',
        )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """cuda: whether the run has CUDA devices (the builder passes its own answer, tests bitsandbytes' CPU backend)."""
    if not on(cfg):
        return
    if not cuda:
        raise NotRunnable(
            "run.mode",
            "qlora needs bitsandbytes on CUDA; it cannot be built on the CPU (the analytic plan covers it)",
            'run it on CUDA GPUs, or use mode = "lora" here',
            what="QLoRA without CUDA",
        )
    if dims.shards_params:
        raise NotRunnable(
            "run.mode",
            f"qlora with parallel.strategy = {dims.strategy} (sharded 4-bit weights) is not run by this engine",
            "use parallel.strategy = ddp",
            what="sharded QLoRA",
        )


def untraceable(r: Resolved) -> str | None:
    if on(r.cfg):
        return (
            "run.mode: qlora needs bitsandbytes on CUDA and cannot be traced on the CPU; "
            "use `trainplan plan` (analytic) for qlora"
        )
    return None
