"""The parallel layout's data-parallel axis: DDP, ZeRO-1/2/3, FSDP2 (tensor and pipeline parallelism are
features/tensor_parallel and features/pipeline_parallel). What each strategy shards is
spec/parallel.py's ParallelDims, the one validated object the plan and the engine share; this module
holds what the engine and the trace cover of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def refuse(r: Resolved) -> None:
    """ParallelDims refuses a layout that does not divide (spec/parallel.py)."""


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if dims.keeps_grad_partition:
        raise NotRunnable(
            "parallel.strategy",
            "zero2 (DeepSpeed's replicated parameters, sharded gradients) is planned but not run by this engine",
            "use parallel.strategy = fsdp-grad-op (FSDP2 without resharding, ZeRO-2-like) or zero3",
            what="ZeRO-2",
        )


def untraceable(r: Resolved) -> str | None:
    return None
