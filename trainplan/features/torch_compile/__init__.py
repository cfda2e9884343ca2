"""train.compile: torch.compile on each decoder layer (regional compilation, run/build.py); the plan
asks inductor's partitioner what a compiled layer saves (features/torch_compile/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError
from trainplan.features import activation_offload

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def active(r: Resolved) -> bool:
    """train.compile resolved: "auto" compiles a training run on GPUs, but not beside activation offload,
    whose hooks need the eager layers' saved tensors."""
    setting = r.cfg.train.compile
    if setting == "auto":
        return r.training and all(d.is_gpu for d in r.devices) and not activation_offload.on(r.cfg)
    return setting


def refuse(r: Resolved) -> None:
    if r.cfg.train.compile is True and activation_offload.on(r.cfg):
        raise ConfigError(
            "train.compile",
            "a compiled layer saves other tensors than the eager one, without the autograd history that tells "
            "memory.offload_activations a weight's copy from an activation",
            'set train.compile = false (or "auto"), or memory.offload_activations = false',
        )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """The engine compiles under every strategy it runs."""


def untraceable(r: Resolved) -> str | None:
    return None  # traced eagerly, and the trace says so (plan/traced.py)
