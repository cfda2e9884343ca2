"""train.compile in the engine: regional compilation of the decoder layers, after the weights are loaded."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainplan.run.converter import decoder_layers


def compile_layers(model: nn.Module, *, backend: Any = "inductor", dynamic: bool | None = None) -> int:
    """train.compile: torch.compile on each decoder layer's forward (regional compilation, as torchtitan
    and torchtune do): every layer runs the same code, so one compiled graph serves them all and compile
    time stays bounded by one layer's; the layers' hooks (FSDP2's, offload's) and checkpointing's wrapper
    stay outside the compiled region. Returns the number of layers compiled. (`backend`, `dynamic`: the
    planner's compile of fake layers, features/torch_compile/plan.py.)"""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=dynamic)
    return len(layers)
