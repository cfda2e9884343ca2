"""Activation checkpointing: the first N decoder layers keep their input (and, under the selective
policy, their matmul and attention outputs) and recompute the rest in backward. "auto" is chosen by
the planner (plan/analytic.py `choose_checkpointing`) before anything plans or builds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

SELECTIVE = "selective"


def selective(cfg: RunConfig) -> bool:
    """memory.checkpointing_policy = "selective": the checkpointed layers keep their matmul outputs too."""
    return cfg.memory.checkpointing_policy == SELECTIVE


def policy(cfg: RunConfig) -> str:
    return cfg.memory.checkpointing_policy


def refuse(r: Resolved) -> None:
    cfg, spec = r.cfg, r.spec
    ac = cfg.memory.activation_checkpointing
    if not isinstance(ac, bool) and isinstance(ac, int) and ac > spec.num_layers:
        raise ConfigError(
            "memory.activation_checkpointing",
            f"{ac} layers, but {spec.name} has {spec.num_layers}",
            f"use at most {spec.num_layers}, or true to checkpoint every layer",
        )
    if selective(cfg) and (spec.mlp.num_experts or spec.derived):
        kind = "a mixture of experts" if spec.mlp.num_experts else "planned from derived terms"
        raise ConfigError(
            "memory.checkpointing_policy",
            f"selective checkpointing is planned for dense layers with hand-written terms; {spec.name} is {kind}",
            'use "full"',
        )
    if selective(cfg) and r.attention == "eager":
        raise ConfigError(
            "memory.checkpointing_policy",
            "selective checkpointing is planned with SDPA attention, and this run uses eager attention",
            'set memory.attention = "sdpa" where the model has it, or use "full"',
        )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """The engine checkpoints any count of layers, under either policy."""


def untraceable(r: Resolved) -> str | None:
    return None
