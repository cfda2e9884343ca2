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

from trainplan.features import optim8bit
from trainplan.run.data import IGNORE_INDEX
from trainplan.run.dist import to_local
from trainplan.run.loss import causal_lm_loss, model_inputs
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


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """How a step computes: precision, device, clipping, and the data-parallel gradient scale."""

    prec: Precision
    device_type: str
    max_grad_norm: float | None = 1.0
    # Data-parallel gradient averaging divides by the world size; the caller passes world here to
    # keep the gradient of sum(token losses) / global tokens.
    grad_scale: float = 1.0


@dataclass(frozen=True)
class Update:
    """The stateful parts of an update (a run's TrainState has the same three)."""

    optimizer: torch.optim.Optimizer
    scheduler: object = None
    scaler: object = None


@dataclass(frozen=True, kw_only=True)
class StepHooks:
    """on_phase marks phase boundaries for the memory meter; decide(loss, grad_norm, loss_scale) is
    the stability guard; inject is fault injection for tests: "nan-loss", "spike" (loss x 10),
    "nan-grad" (one gradient element)."""

    on_phase: Callable[[str], None] = lambda phase: None
    decide: Callable[[torch.Tensor, torch.Tensor, float | None], bool] | None = None
    inject: Sequence[str] = ()


NO_HOOKS = StepHooks()


def train_step(
    model: nn.Module,
    update,
    micro_batches: Sequence[dict],
    settings: StepSettings,
    *,
    token_count: int | None = None,
    hooks: StepHooks = NO_HOOKS,
) -> StepResult:
    """Accumulate gradients over `micro_batches`, then clip and step.

    The loss is normalised by the tokens of the whole accumulation window (`token_count`,
    summed over data-parallel ranks by the caller), not per micro-batch, so accumulation
    matches one big batch. `update` holds the optimizer, scheduler and GradScaler (an `Update`
    or the run's TrainState).

    `hooks.decide` runs after the gradients are complete and before anything changes: False skips
    the update, so neither the weights, the optimizer state nor the LR scheduler move. With a
    GradScaler, a step the scaler skipped for inf gradients does not advance the scheduler either.
    """
    tokens = token_count if token_count is not None else sum(target_tokens(mb) for mb in micro_batches)
    in_backward = isinstance(update.optimizer, InBackward)
    if in_backward:
        update.optimizer.begin()
    total = _accumulate(model, micro_batches, settings, update.scaler, tokens, hooks)
    if in_backward:  # every parameter was updated in backward, and its gradient freed: no optimizer phase
        norm = update.optimizer.grad_norm()
        applied = apply_update(update, hooks.decide, total, norm)
        hooks.on_phase("end")
        return StepResult(loss=total, grad_norm=norm, tokens=tokens, applied=applied)
    hooks.on_phase("optimizer")
    params = [p for p in model.parameters() if p.grad is not None]
    if "nan-grad" in hooks.inject:  # on this rank's first non-empty gradient (FSDP shards can be empty)
        target = next((g for g in (to_local(p.grad) for p in params) if g.numel()), None)
        if target is not None:
            target.view(-1)[0] = float("nan")
    if update.scaler is not None:
        update.scaler.unscale_(update.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm or float("inf"))
    applied = apply_update(update, hooks.decide, total, norm)
    update.optimizer.zero_grad(set_to_none=True)
    hooks.on_phase("end")
    return StepResult(loss=total, grad_norm=norm, tokens=tokens, applied=applied)


def _accumulate(model, micro_batches, settings: StepSettings, scaler, tokens: int, hooks: StepHooks) -> torch.Tensor:
    """Forward and backward over the accumulation window; returns the window's summed loss."""
    total = None
    for mb in micro_batches:
        hooks.on_phase("forward")
        with autocast(settings.prec, settings.device_type):
            loss = causal_lm_loss(model, mb, tokens)
        if "nan-loss" in hooks.inject:
            loss = loss * float("nan")
        elif "spike" in hooks.inject:
            loss = loss * 10.0
        hooks.on_phase("backward")
        scaled = loss * settings.grad_scale if settings.grad_scale != 1.0 else loss
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    return total


def apply_update(update, decide, loss: torch.Tensor, norm: torch.Tensor) -> bool:
    """The guard's decision, then the optimizer (through the GradScaler) and the scheduler."""
    scaler = update.scaler
    scale = scaler.get_scale() if scaler is not None else None
    applied = decide is None or decide(loss, norm, scale)
    if not applied:
        if scaler is not None:
            scaler.update()  # the scaler still learns from this step's inf check
    elif scaler is not None:
        scaler.step(update.optimizer)
        scaler.update()
        applied = scaler.get_scale() >= scale  # a lowered scale means the scaler skipped the step
    else:
        update.optimizer.step()
    if applied and update.scheduler is not None:
        update.scheduler.step()
    return applied


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
        loss = model(**model_inputs(batch), labels=batch["labels"]).loss
    on_phase("end")
    return loss


class InBackward(torch.optim.Optimizer):
    """torchtune's optimizer in backward: one optimizer per parameter, stepped by a post-accumulate-grad
    hook as soon as the parameter's gradient is formed, which then frees it, so the step's gradients
    never exist at once. To the run it is one optimizer: `param_groups` are the per-parameter
    optimizers' own groups (an LR scheduler sets each, the same schedule), `state` and
    `state_dict()` those of a single optimizer over the same parameters, `step()` does nothing
    (the updates ran in backward). No clipping and no accumulation: resolve() refuses both."""

    def __init__(self, params: list[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.inner = [make([p]) for p in params]
        super().__init__(params, {})
        self.param_groups = [o.param_groups[0] for o in self.inner]
        self._norms: dict[int, torch.Tensor] = {}
        self._bind_state()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, i: int):
        inner = self.inner[i]

        def step_now(p: nn.Parameter) -> None:
            # the norm clip_grad_norm_ would take of this gradient, for the step's global norm
            self._norms[i] = torch.linalg.vector_norm(p.grad.detach(), 2.0)
            inner.step()
            p.grad = None

        return step_now

    def _bind_state(self) -> None:
        """`state` as one optimizer has it: each inner optimizer's (live) entry for its parameter."""
        self.state = {o.param_groups[0]["params"][0]: o.state[o.param_groups[0]["params"][0]] for o in self.inner}

    def begin(self) -> None:
        self._norms.clear()

    def grad_norm(self) -> torch.Tensor:
        """The step's global gradient norm, as clip_grad_norm_ computes it: the norm of the per-tensor norms."""
        norms = [self._norms[i] for i in sorted(self._norms)]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.inner:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """The layout of one optimizer over the same parameters: state by parameter index, one group each."""
        parts = [o.state_dict() for o in self.inner]
        state = {i: part["state"][0] for i, part in enumerate(parts) if 0 in part["state"]}
        groups = [{**part["param_groups"][0], "params": [i]} for i, part in enumerate(parts)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.inner):
            raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer {len(self.inner)}")
        for i, (o, group) in enumerate(zip(self.inner, groups, strict=True)):
            state = {0: state_dict["state"][i]} if i in state_dict["state"] else {}
            o.load_state_dict({"state": state, "param_groups": [{**group, "params": [0]}]})
        self.param_groups = [o.param_groups[0] for o in self.inner]
        self._bind_state()


def build_optimizer(
    model: nn.Module,
    name: str,
    impl: str,
    lr: float,
    weight_decay: float,
    device_type: str,
    *,
    zero1: bool = False,
    in_backward: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer the plan assumed: `impl` auto means torch's own default for the device.
    in_backward: one per parameter, stepped inside backward (InBackward)."""
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
    elif optim8bit.is_8bit(name):
        # bitsandbytes' blockwise 8-bit AdamW: its CUDA kernels, or its CPU backend (no implementation
        # choice: one kernel per tensor). Not the paged variant: its unified-memory states are
        # outside the device's allocator, so neither the plan nor the allocator could count them.
        import bitsandbytes as bnb

        cls, kwargs = bnb.optim.AdamW8bit, {"lr": lr, "weight_decay": weight_decay}
    else:
        cls = None
    if cls is not None and in_backward:
        return InBackward(params, lambda group: cls(group, **kwargs))
    if cls is not None and zero1:  # ZeRO-1: each rank keeps the states of its share of the parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    if cls is not None:
        return cls(params, **kwargs)
    raise TrainplanError(f"optim.name: {name} is not an optimizer this engine builds; use adamw")
