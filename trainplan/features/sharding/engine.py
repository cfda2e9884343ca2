"""The sharding strategies in the engine: FSDP2's `fully_shard` per decoder layer and the root."""

from __future__ import annotations

import torch
from torch import nn

from trainplan.features import optimizer_offload
from trainplan.run.converter import Build, decoder_layers, dtypes
from trainplan.spec.parallel import ParallelDims
from trainplan.spec.precision import Precision


def apply_fsdp(model: nn.Module, dims: ParallelDims, prec: Precision, mesh) -> nn.Module:
    """FSDP2: one unit per decoder layer plus the root; mixed precision through the policy.
    parallel.offload_optimizer: CPUOffloadPolicy keeps the parameter shards, their gradients and the
    optimizer step in host memory (pinned for CUDA's copies); `materialize_params_on_host` says where
    the parameters are allocated. Under pipeline parallelism the root is the stage's forward module,
    which the pipeline shards once it exists (`shard_stage`): here only the stage's decoder layers."""
    for layer in decoder_layers(model):
        _shard(layer, dims, prec, mesh, reshard=dims.reshard_after_forward)
    if dims.pp == 1:
        _shard(model, dims, prec, mesh, reshard=dims.reshard_after_forward)
    return model


def shard_stage(module: nn.Module, dims: ParallelDims, prec: Precision, mesh) -> nn.Module:
    """A pipeline stage's root unit (its embedding, final norm and head, whichever it holds) over the
    stage's replicas. Not resharded after forward (FSDP2's own choice for a root): the schedule's loss
    multiplies the last stage's output through the head outside the stage's forward."""
    return _shard(module, dims, prec, mesh, reshard=False)


def _shard(module: nn.Module, dims: ParallelDims, prec: Precision, mesh, *, reshard: bool) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dt = dtypes(prec)
    mp = MixedPrecisionPolicy(
        param_dtype=dt.compute, reduce_dtype=torch.float32 if prec.grad_bytes == 4 else dt.compute
    )
    on_host = optimizer_offload.on_host(dims)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if on_host else OffloadPolicy()
    mesh = mesh["dp"] if mesh.ndim > 1 else mesh  # 2-D: FSDP2 over the data-parallel axis of (dp, tp) or (pp, dp)
    return fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: FSDP2 (with optimizer offload's CPUOffloadPolicy where it is on); DDP and
    ZeRO-1 wrap the model later (run/dist.py `wrap`)."""
    if b.dims is not None and b.dims.shards_params:
        return apply_fsdp(model, b.dims, b.prec, b.mesh)
    return model
