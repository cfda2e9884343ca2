"""The mode contract, checked after every run.

| mode      | contract                                                   |
|-----------|------------------------------------------------------------|
| lora      | base weights bitwise unchanged; every adapter tensor changed (after one update: every lora_B) |
| full      | every trainable tensor changed                              |
| inference | nothing changed; no gradient exists                         |

Training modes also fail when a trained tensor or the held-out loss ends non-finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from trainplan.features import lora
from trainplan.run.dist import to_local


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter (the local shard under FSDP)."""
    return {n: to_local(p).detach().to("cpu", copy=True) for n, p in model.named_parameters()}


@dataclass(frozen=True)
class ContractResult:
    mode: str
    passed: bool
    detail: str
    changed: int
    unchanged: int

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "passed": self.passed,
            "detail": self.detail,
            "changed": self.changed,
            "unchanged": self.unchanged,
        }


def check(
    mode: str,
    model: nn.Module,
    before: dict[str, torch.Tensor],
    *,
    optimizer=None,
    updates: int | None = None,
    held_out_loss: float | None = None,
) -> ContractResult:
    """updates: optimizer updates this run applied. PEFT initialises lora_B to zero, so lora_A's
    gradient is zero at the first update: after exactly one, only lora_B can have changed."""
    after = {n: to_local(p).detach().cpu() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    if mode == "inference":
        grads = [n for n, p in model.named_parameters() if p.grad is not None]
        ok = not changed and not grads and optimizer is None
        detail = (
            "no parameter changed, no gradient, no optimizer"
            if ok
            else f"{len(changed)} changed, {len(grads)} with gradients, optimizer {optimizer is not None}"
        )
    elif mode in lora.ADAPTER_MODES:
        base_changed = sorted(changed - trainable)
        expected = {n for n in trainable if "lora_A" not in n} if updates == 1 else trainable
        adapters_still = sorted(expected - changed)
        ok = not base_changed and not adapters_still and bool(expected)
        which = (
            f"all {len(expected)} lora_B tensors changed (lora_A cannot change at the first update: PEFT "
            "initialises lora_B to zero)"
            if expected != trainable
            else f"all {len(trainable)} adapter tensors changed"
        )
        detail = (
            f"base bitwise unchanged ({len(after) - len(trainable)} tensors); {which}"
            if ok
            else f"base tensors changed: {base_changed[:3]}; adapter tensors unchanged: {adapters_still[:3]}"
        )
    else:
        unchanged = sorted(trainable - changed)
        ok = not unchanged and bool(trainable)
        detail = f"all {len(trainable)} trainable tensors changed" if ok else f"unchanged: {unchanged[:3]}"
    broken = sorted(n for n in trainable if not torch.isfinite(after[n]).all())
    if broken:  # a run that ends with NaN or inf weights has no result to stand behind
        ok, detail = False, f"non-finite values in {len(broken)} trained tensors, e.g. {broken[0]}"
    elif held_out_loss is not None and not math.isfinite(held_out_loss):
        ok, detail = False, f"the held-out loss after the run is {held_out_loss}"
    return ContractResult(
        mode=mode, passed=ok, detail=detail, changed=len(changed), unchanged=len(after) - len(changed)
    )


def of_stages(results: list[ContractResult], dims) -> ContractResult:
    """The contract of a pipeline's model from every rank's (in rank order; dims: the layout): it holds
    when it holds on every rank; the detail and the counts are the first replica's stages, whose
    tensors are disjoint, so their counts add up."""
    first = [r for rank, r in enumerate(results) if dims.coords(rank)[1] == 0]  # (stage, replica 0)
    return ContractResult(
        mode=results[0].mode,
        passed=all(r.passed for r in results),
        detail="; ".join(f"stage {i}: {r.detail}" for i, r in enumerate(first)),
        changed=sum(r.changed for r in first),
        unchanged=sum(r.unchanged for r in first),
    )
