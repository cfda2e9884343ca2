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
    the parameters are allocated."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dt = dtypes(prec)
    mp = MixedPrecisionPolicy(
        param_dtype=dt.compute, reduce_dtype=torch.float32 if prec.grad_bytes == 4 else dt.compute
    )
    on_host = optimizer_offload.on_host(dims)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if on_host else OffloadPolicy()
    reshard = dims.reshard_after_forward
    mesh = mesh["dp"] if mesh.ndim > 1 else mesh  # 2-D: FSDP2 over the data-parallel axis of (dp, tp)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    return model


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: FSDP2 (with optimizer offload's CPUOffloadPolicy where it is on); DDP and
    ZeRO-1 wrap the model later (run/dist.py `wrap`)."""
    if b.dims is not None and b.dims.shards_params:
        return apply_fsdp(model, b.dims, b.prec, b.mesh)
    return model
