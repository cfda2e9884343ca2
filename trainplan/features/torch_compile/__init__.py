"""train.compile: torch.compile on each decoder layer (regional compilation, run/build.py); the plan
asks inductor's partitioner what a compiled layer saves (features/torch_compile/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError, NotRunnable
from trainplan.features import activation_offload, tiled_mlp

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def active(r: Resolved) -> bool:
    """train.compile resolved: "auto" compiles a training run on GPUs, but not beside activation offload,
    whose hooks need the eager layers' saved tensors, nor a tensor-, pipeline- or context-parallel one (the
    plan has no compiled terms for their layers; an explicit true is refused there)."""
    setting = r.cfg.train.compile
    if setting == "auto":
        eager_only = activation_offload.on(r.cfg) or r.dims.tp > 1 or r.dims.pp > 1 or r.dims.cp > 1
        eager_only = eager_only or tiled_mlp.on(r.cfg)
        return r.training and all(d.is_gpu for d in r.devices) and not eager_only
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
    """The engine compiles under every data-parallel strategy it runs, not the tp split nor pipeline stages."""
    layouts = (("parallel.tp", "tensor", dims.tp > 1), ("parallel.pp", "pipeline", dims.pp > 1))
    for field, name, on in (*layouts, ("parallel.cp", "context", dims.cp > 1)):
        if cfg.train.compile is True and on:
            fix = f'set train.compile = false (or "auto") with {field}, or {field} = 1'
            raise NotRunnable.beside("train.compile", "torch.compile", f"{name} parallelism", fix)
    if cfg.train.compile is True and tiled_mlp.on(cfg):  # its recompute runs inside backward, a tile at a time
        fix = 'set train.compile = false (or "auto"), or memory.tiled_mlp = false'
        raise NotRunnable.beside("train.compile", "torch.compile", "the tiled MLP", fix)


def untraceable(r: Resolved) -> str | None:
    return None  # traced eagerly, and the trace says so (plan/traced.py)
