"""optim.step_in_backward: each parameter is updated by its own optimizer as soon as its gradient is
formed, and the gradient freed (run/setup.py registers the hooks; its plan.py bills one gradient
at a time). Whatever needs every gradient of the step before the first update cannot run with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError
from trainplan.features import optimizer_offload

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def on(cfg: RunConfig) -> bool:
    """Set, and a training run (inference has no step)."""
    return cfg.optim.step_in_backward and cfg.mode != "inference"


def refuse(r: Resolved) -> None:
    cfg, dims, batch = r.cfg, r.dims, r.batch
    if not on(cfg):
        return
    refusals = (
        (
            batch.grad_accum_steps > 1,
            "batch.grad_accum_steps",
            f"is {batch.grad_accum_steps}, but optim.step_in_backward updates the weights in every backward, "
            "so gradients cannot accumulate over micro-batches",
            "set batch.global_batch_size = batch.micro_batch_size x data-parallel degree (accumulation 1), "
            "or optim.step_in_backward = false",
        ),
        (
            cfg.train.max_grad_norm > 0,
            "train.max_grad_norm",
            f"is {cfg.train.max_grad_norm:g}: clipping by the global norm needs every gradient before the first "
            "update, but optim.step_in_backward updates each parameter as its gradient is formed",
            "set train.max_grad_norm = 0 (no clipping), or optim.step_in_backward = false",
        ),
        (
            dims.world_size > 1,
            "optim.step_in_backward",
            f"runs in one process only, not on {dims.world_size} devices: the hook fires on the local gradient, "
            "before DDP's all-reduce (or FSDP's reduce-scatter) has averaged it across ranks",
            "plan one device, or set optim.step_in_backward = false",
        ),
        (
            r.precision.loss_scaling,
            "run.precision",
            f"{cfg.precision} scales the loss, and the GradScaler must see every gradient for inf before any "
            "update, which optim.step_in_backward applies in backward",
            'use precision = "amp-bf16" or "fp32", or optim.step_in_backward = false',
        ),
        (
            cfg.guard.enabled,
            "guard.enabled",
            "the stability guard decides whether to apply a step after its gradients are complete, but "
            "optim.step_in_backward has applied each update by then",
            "set guard.enabled = false, or optim.step_in_backward = false",
        ),
        (
            cfg.train.largest_batch_first,
            "train.largest_batch_first",
            "the memory probe's backward would update the weights: optim.step_in_backward steps in backward",
            "set train.largest_batch_first = false, or optim.step_in_backward = false",
        ),
        (
            optimizer_offload.on(cfg),
            "parallel.offload_optimizer",
            "offloaded states are stepped on the host after backward, not inside it",
            "set parallel.offload_optimizer = false, or optim.step_in_backward = false",
        ),
    )
    for refused, field, problem, fix in refusals:
        if refused:
            raise ConfigError(field, problem, fix)


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """What the planner allows (refuse), the engine runs."""


def untraceable(r: Resolved) -> str | None:
    if on(r.cfg):
        return (
            "optim.step_in_backward: the trace runs the plain optimizer step; use `trainplan plan` (analytic), "
            "or `trainplan accept` to measure the run"
        )
    return None
