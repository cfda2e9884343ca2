"""LoRA (Hu et al. 2021): low-rank adapters on the frozen base's linear layers; QLoRA's adapters too
(features/qlora/ adds the 4-bit base under them)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from trainplan.errors import ConfigError

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.model import ModelSpec
    from trainplan.spec.parallel import ParallelDims

ADAPTER_MODES = ("lora", "qlora")


def on(cfg: RunConfig) -> bool:
    """The job trains adapters (LoRA or QLoRA)."""
    return cfg.mode in ADAPTER_MODES


def with_modules(cfg: RunConfig, spec: ModelSpec) -> RunConfig:
    """cfg with its LoRA target sets ("attention", "all-linear") expanded to spec's module names."""
    modules = list(spec.lora_modules(cfg.lora.target_modules))
    if not modules and not on(cfg):  # no adapters to place: the unused setting stays as given
        return cfg
    if not modules:  # "attention" on a layer with no attention projection (a Mamba or linear-attention layer)
        known = sorted({lin.module for lin in spec.layer_linears})
        raise ConfigError(
            "lora.target_modules",
            f"{', '.join(map(repr, cfg.lora.target_modules))} names no linear layer of {spec.name}: its first decoder "
            f"layer has no attention projection (q_proj, v_proj or a fused qkv), only {', '.join(known) or 'none'}",
            f"name the modules to adapt, e.g. target_modules = {json.dumps(known[:2])}",
        )
    if modules == cfg.lora.target_modules:  # already module names (the advisor's rungs)
        return cfg
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=modules))


def refuse(r: Resolved) -> None:
    if not on(r.cfg):
        return
    known = {lin.module for lin in r.spec.layer_linears}
    for target in r.cfg.lora.target_modules:
        if target not in known:
            raise ConfigError(
                "lora.target_modules",
                f"{target!r} matches no linear layer of {r.spec.name}",
                "its linear layers are " + ", ".join(sorted(known)),
            )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """The engine runs LoRA everywhere it runs full fine-tuning."""


def untraceable(r: Resolved) -> str | None:
    return None
