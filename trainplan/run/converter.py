"""What the engine's converters share (run/build.py CONVERTERS, each feature's `engine.apply`): the
job a converter reads, the dtypes a precision stores and computes in, and the model's decoder layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainplan.config import RunConfig
from trainplan.errors import TrainplanError
from trainplan.spec.model import ModelSpec
from trainplan.spec.parallel import ParallelDims
from trainplan.spec.precision import Precision


@dataclass(frozen=True)
class Dtypes:
    param: torch.dtype  # trainable parameters as stored
    frozen: torch.dtype  # frozen parameters as stored
    compute: torch.dtype


def dtypes(prec: Precision) -> Dtypes:
    half = torch.float16 if prec.loss_scaling else torch.bfloat16
    by_bytes = {4: torch.float32, 2: half}
    return Dtypes(
        param=by_bytes[prec.param_bytes], frozen=by_bytes[prec.frozen_bytes], compute=by_bytes[prec.compute_bytes]
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (FSDP units, checkpointing units), found through PEFT wrappers too; a pipeline
    stage's, which it keeps under their indices in the whole model (features/pipeline_parallel/engine.py)."""
    for module in model.modules():
        for name in ("layers", "h"):
            blocks = getattr(module, name, None)
            if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) and len(blocks) and module is not model:
                return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    raise TrainplanError("model.source: cannot find the decoder layers of this model")


@dataclass(frozen=True)
class Build:
    """What a converter reads: the job's model, settings and layout (dims None: one process, no mesh)."""

    spec: ModelSpec
    cfg: RunConfig
    prec: Precision
    dims: ParallelDims | None
    mesh: Any
    stage: int = 0  # this rank's pipeline stage (dims.pp > 1)
