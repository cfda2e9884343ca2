"""parallel.offload_optimizer: optimizer states (and, under FSDP2's CPUOffloadPolicy, the parameter
shards and their gradients) in host memory, the step run there. The engine runs FSDP2's policy; the
planner also covers DeepSpeed's ZeRO-Offload beside DDP and ZeRO-1/2 (planned, not run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError, NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

FSDP2_STRATEGIES = ("zero3", "fsdp-grad-op")  # the strategies FSDP2 runs (parameters sharded)


def on(cfg: RunConfig) -> bool:
    return cfg.parallel.offload_optimizer


def how(r: Resolved, *, cpu: bool) -> str:
    """How it runs on a rank: "fsdp2" (FSDP2's CPUOffloadPolicy: each rank's parameter shards, their
    gradients and the optimizer step on the host), "zero-offload" (DeepSpeed's, planned but not run:
    states, step and a gradient copy on the host), "none on the CPU" (the host is the device), or ""."""
    if not r.dims.offload_optimizer or not r.training:
        return ""
    if cpu:
        return "none on the CPU"
    return "fsdp2" if r.dims.shards_params else "zero-offload"


def on_host(dims: ParallelDims | None) -> bool:
    """FSDP2's CPUOffloadPolicy: the parameters are allocated in host memory (buffers on the device), and
    the optimizer steps there."""
    return dims is not None and dims.shards_params and dims.offload_optimizer


def refuse(r: Resolved) -> None:
    cfg = r.cfg
    if not on(cfg):
        return
    if cfg.mode == "inference":
        raise ConfigError(
            "parallel.offload_optimizer",
            "inference has no optimizer (or gradients) to offload",
            "set parallel.offload_optimizer = false",
        )
    if any(not d.is_gpu for d in r.devices) and cfg.parallel.strategy not in FSDP2_STRATEGIES:
        raise ConfigError(
            "parallel.offload_optimizer",
            f"on the CPU only FSDP2's offload runs, and parallel.strategy is {cfg.parallel.strategy} (there it moves "
            "nothing: the host is the device)",
            'set parallel.strategy = "zero3" or "fsdp-grad-op", or parallel.offload_optimizer = false',
        )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if on(cfg) and cfg.mode != "inference" and not dims.shards_params:
        raise NotRunnable(
            "parallel.offload_optimizer",
            "the engine offloads through FSDP2's CPUOffloadPolicy (parameter shards, their gradients and the "
            f"optimizer on the host), on one device or many; {cfg.parallel.strategy} with offload is planned as "
            "DeepSpeed's ZeRO-Offload but not run",
            'set parallel.strategy = "zero3", or parallel.offload_optimizer = false',
            what="optimizer offload without FSDP2",
        )


def untraceable(r: Resolved) -> str | None:
    if on(r.cfg) and r.training and r.dims.shards_params and r.devices[0].is_gpu:
        return (
            "parallel.offload_optimizer: the trace runs on one fake device and cannot tell the host's parameter "
            "shards and optimizer state from the GPU's; use `trainplan plan` (analytic), or `trainplan accept` to "
            "measure the run"
        )
    return None
