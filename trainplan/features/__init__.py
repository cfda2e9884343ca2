"""The memory options, one folder each (trainplan/features/<name>/): every rule of an option lives there,
and each side is applied in one fixed order (torchtitan's model converters, each one pass).

  __init__.py  its rules, read by resolve and everyone above (this package imports only these):
    on(cfg) / active(r)        whether the option is set / in force for a resolved job
    refuse(r)                  the one-line refusals of a job that cannot be planned (ConfigError)
    runnable(cfg, dims, cuda)  what `trainplan train` cannot run (NotRunnable), asked by train and advise
    untraceable(r)             why the fake-tensor trace cannot cover the job, or None
  plan.py      where it reshapes a rank's step: adjust(ctx, bill, terms) -> bill, applied in
               plan/analytic.py ADJUSTMENTS order (the planner's room: no torch)
  engine.py    what it does to the model: apply(model, build) -> model, applied in run/build.py
               CONVERTERS order (the engine's room)
A feature that changes one component's size only (LoRA's adapters, QLoRA's NF4 weights, 8-bit states)
is read by that component's term (plan/terms.py) through the feature's own functions, never through the
config field itself (tests/test_features.py holds that line, and that every plan.py and engine.py hook
is applied).

The rules are the foundation: they import config, errors and spec only, and no torch, so `trainplan
plan` stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import TrainplanError
from trainplan.features import (
    activation_offload,
    checkpointing,
    context_parallel,
    lora,
    optim8bit,
    optimizer_offload,
    pipeline_parallel,
    qlora,
    sharding,
    step_in_backward,
    tensor_parallel,
    tiled_mlp,
    torch_compile,
)

if TYPE_CHECKING:  # a type only: resolve imports this package
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

# The order their rules are asked in: the layout first (what the engine runs of it decides most),
# then the optimizer's, then the model's. The first refusal is the one reported.
FEATURES = (
    pipeline_parallel,
    sharding,
    tensor_parallel,
    context_parallel,
    optim8bit,
    optimizer_offload,
    qlora,
    lora,
    checkpointing,
    activation_offload,
    tiled_mlp,
    torch_compile,
    step_in_backward,
)


def refuse(r: Resolved) -> None:
    """Every feature's refusal of a job that cannot be planned, in registry order (the first one raises)."""
    for feature in FEATURES:
        feature.refuse(r)


def require_runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    """Every feature's refusal of what `trainplan train` cannot run (NotRunnable)."""
    for feature in FEATURES:
        feature.runnable(cfg, dims, cuda=cuda)


def check_traceable(r: Resolved) -> None:
    """Refuse a job the fake-tensor trace cannot cover, with the feature's reason."""
    for feature in FEATURES:
        why = feature.untraceable(r)
        if why:
            raise TrainplanError(why)
