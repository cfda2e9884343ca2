"""The parallel layout: data parallelism (DDP, ZeRO-1/2/3, FSDP2) and, planned only so far, pipeline
parallelism (tensor parallelism is features/tensor_parallel). What each strategy shards is
spec/parallel.py's ParallelDims, the one validated object the plan and the engine share; this module
holds what the engine and the trace cover of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError, NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def model_parallel(dims: ParallelDims) -> bool:
    """Tensor or pipeline parallelism."""
    return dims.tp > 1 or dims.pp > 1


def require_data_parallel(dims: ParallelDims, who: str, fix: str) -> None:
    """Refuse tensor and pipeline parallelism where `who` covers data parallelism only."""
    if model_parallel(dims):
        raise ConfigError("parallel.tp", f"{who} cover data parallelism (DDP, ZeRO, FSDP) only", fix)


def refuse(r: Resolved) -> None:
    """ParallelDims refuses a layout that does not divide (spec/parallel.py)."""


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if dims.pp > 1:
        raise NotRunnable(
            "parallel.pp",
            "the training engine runs data and tensor parallelism (DDP, ZeRO-1, FSDP2, tp); pipeline stages "
            "are planned, not run",
            "set parallel.pp = 1 for `trainplan train`",
            what="pipeline parallelism",
        )
    if dims.keeps_grad_partition:
        raise NotRunnable(
            "parallel.strategy",
            "zero2 (DeepSpeed's replicated parameters, sharded gradients) is planned but not run by this engine",
            "use parallel.strategy = fsdp-grad-op (FSDP2 without resharding, ZeRO-2-like) or zero3",
            what="ZeRO-2",
        )


def untraceable(r: Resolved) -> str | None:
    if r.dims.pp > 1:
        return (
            "parallel.pp: the trace covers data and tensor parallelism only; use `trainplan plan` for pipeline stages"
        )
    return None
