"""LoRA in the engine: PEFT's adapters on the resolved target modules, the base frozen (QLoRA's 4-bit
base is features/qlora/engine.py, applied before this)."""

from __future__ import annotations

import warnings

from torch import nn

from trainplan.config import RunConfig
from trainplan.features import lora
from trainplan.run.converter import Build


def apply_mode(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """full: everything trains. lora/qlora: PEFT adapters, base frozen. inference: nothing trains."""
    if cfg.mode == "full":
        model.requires_grad_(True)
        return model
    model.requires_grad_(False)
    if cfg.mode == "inference":
        return model.eval()
    import peft

    adapters = peft.LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    # PEFT upcasts the adapters to fp32 when the base is 16-bit (autocast_adapter_dtype=True).
    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return peft.get_peft_model(model, adapters)


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: what trains, and LoRA's adapters (target sets expanded, however cfg came)."""
    return apply_mode(model, lora.with_modules(b.cfg, b.spec))
