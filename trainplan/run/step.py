"""One optimizer step: forward/backward over the accumulation window, then the update.

The tracer and the training loop call this same function; `on_phase` marks phase boundaries
("forward", "backward", "optimizer", "end") so memory can be measured per phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainplan.run.data import IGNORE_INDEX
from trainplan.run.loss import causal_lm_loss
from trainplan.spec.precision import Precision


@dataclass(frozen=True)
class StepResult:
    """Tensors, not floats: under the tracer's fake mode there are no values to read."""

    loss: torch.Tensor  # mean token loss over the accumulation window
    grad_norm: torch.Tensor
    tokens: int
    applied: bool = True  # False: the guard or the GradScaler skipped the update


def autocast(prec: Precision, device_type: str):
    if not prec.autocast:
        return contextlib.nullcontext()
    dtype = torch.float16 if prec.loss_scaling else torch.bfloat16
    return torch.autocast(device_type=device_type, dtype=dtype)


def target_tokens(batch: dict) -> int:
    """Tokens that carry a loss: labels are shifted inside the model, so position 0 never does."""
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[dict],
    *,
    prec: Precision,
    device_type: str,
    scaler=None,
    max_grad_norm: float | None = 1.0,
    on_phase: Callable[[str], None] = lambda phase: None,
    token_count: int | None = None,
    grad_scale: float = 1.0,
    scheduler=None,
    decide: Callable[[torch.Tensor, torch.Tensor, float | None], bool] | None = None,
    inject: Sequence[str] = (),
) -> StepResult:
    """Accumulate gradients over `micro_batches`, then clip and step.

    The loss is normalised by the tokens of the whole accumulation window (`token_count`,
    summed over data-parallel ranks by the caller), not per micro-batch, so accumulation
    matches one big batch. Data-parallel gradient averaging divides by the world size, so the
    caller passes grad_scale=world to keep the gradient of sum(token losses) / global tokens.

    `decide(loss, grad_norm, loss_scale)` (the stability guard) runs after the gradients are
    complete and before anything changes: False skips the update, so neither the weights, the
    optimizer state nor the LR scheduler move. With a GradScaler, a step the scaler skipped for
    inf gradients does not advance the scheduler either. `inject` is fault injection for tests:
    "nan-loss", "spike" (loss x 10), "nan-grad" (one gradient element).
    """
    tokens = token_count if token_count is not None else sum(target_tokens(mb) for mb in micro_batches)
    total = None
    for mb in micro_batches:
        on_phase("forward")
        with autocast(prec, device_type):
            loss = causal_lm_loss(model, mb, tokens)
        if "nan-loss" in inject:
            loss = loss * float("nan")
        elif "spike" in inject:
            loss = loss * 10.0
        on_phase("backward")
        scaled = loss * grad_scale if grad_scale != 1.0 else loss
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    on_phase("optimizer")
    params = [p for p in model.parameters() if p.grad is not None]
    if "nan-grad" in inject:  # on this rank's first non-empty gradient (FSDP shards can be empty)
        local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params)]
        target = next((g for g in local if g.numel()), None)
        if target is not None:
            target.view(-1)[0] = float("nan")
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    scale = scaler.get_scale() if scaler is not None else None
    applied = decide is None or decide(total, norm, scale)
    if not applied:
        if scaler is not None:
            scaler.update()  # the scaler still learns from this step's inf check
    elif scaler is not None:
        scaler.step(optimizer)
        scaler.update()
        applied = scaler.get_scale() >= scale  # a lowered scale means the scaler skipped the step
    else:
        optimizer.step()
    if applied and scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    on_phase("end")
    return StepResult(loss=total, grad_norm=norm, tokens=tokens, applied=applied)


def eval_forward(
    model: nn.Module,
    batch: dict,
    *,
    prec: Precision,
    device_type: str,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> torch.Tensor:
    """Inference: one forward under inference_mode; no graph, no gradients."""
    on_phase("inference")
    with torch.inference_mode(), autocast(prec, device_type):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    on_phase("end")
    return loss


def build_optimizer(
    model: nn.Module,
    name: str,
    impl: str,
    lr: float,
    weight_decay: float,
    device_type: str,
    *,
    zero1: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer the plan assumed: `impl` auto means torch's own default for the device."""
    from trainplan.errors import TrainplanError

    params = [p for p in model.parameters() if p.requires_grad]
    flags = {}
    if impl == "auto":
        impl = "foreach" if device_type == "cuda" else "for-loop"
    if impl == "foreach":
        flags = {"foreach": True}
    elif impl == "fused":
        flags = {"fused": True}
    elif impl == "for-loop":
        flags = {"foreach": False}
    if name == "adamw":
        cls, kwargs = torch.optim.AdamW, {"lr": lr, "weight_decay": weight_decay, **flags}
    elif name in ("sgd", "sgd-momentum"):
        momentum = 0.9 if name == "sgd-momentum" else 0.0
        cls = torch.optim.SGD
        kwargs = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        kwargs.update({k: v for k, v in flags.items() if k != "fused"})
    elif name == "adafactor":
        cls = torch.optim.Adafactor
        kwargs = {"lr": lr, "weight_decay": weight_decay, **{k: v for k, v in flags.items() if k == "foreach"}}
    else:
        cls = None
    if cls is not None and zero1:  # ZeRO-1: each rank keeps the states of its share of the parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    if cls is not None:
        return cls(params, **kwargs)
    raise TrainplanError(f"optim.name: {name} needs bitsandbytes on CUDA; use adamw on this device")
