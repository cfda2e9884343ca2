"""Activation checkpointing in the engine: transformers' per-layer switch on the first N decoder layers,
full or selective (torch's selective activation checkpoint)."""

from __future__ import annotations

import torch
from torch import nn

from trainplan.errors import ConfigError
from trainplan.features import checkpointing
from trainplan.run.converter import Build

# Selective checkpointing keeps these ops' outputs and recomputes the rest (norms, activations,
# RoPE, residual adds): the matmuls and attention hold most of a layer's compute, the element-wise
# ops most of its saved bytes. torch's selective activation checkpoint (torch.utils.checkpoint).
SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def _selective_context():
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, name).default for name in SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def checkpoint_layers(model: nn.Module, spec, setting: bool | int | str, policy: str = "full") -> None:
    """Activation checkpointing on the first N decoder layers (True: every one). The first ones
    hold their activations longest (backward reaches them last), so they are the ones to recompute.
    transformers' switch turns it on for every layer; the layers from N on are turned back off.
    policy "selective": the checkpointed layers keep their matmul and attention outputs (SAVED_OPS)."""
    if setting == "auto":
        raise ConfigError(
            "memory.activation_checkpointing",
            '"auto" is chosen by the planner before a run, and this run was started without it',
            "start it with `trainplan train` (which chooses), or give a number of layers",
        )
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}
    if policy == checkpointing.SELECTIVE:
        kwargs["context_fn"] = _selective_context()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(layers) != spec.num_layers:
        raise AssertionError(f"found {len(layers)} decoder layers to checkpoint, the spec has {spec.num_layers}")
    if setting is not True:
        for layer in layers[setting:]:
            layer.gradient_checkpointing = False


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: the first memory.activation_checkpointing layers recompute in backward."""
    ac = b.cfg.memory.activation_checkpointing
    if ac is not False and b.cfg.mode != "inference":
        checkpoint_layers(model, b.spec, ac, checkpointing.policy(b.cfg))
    return model
