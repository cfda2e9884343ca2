"""Instability detection: non-finite values and z-score spikes against a rolling window.

`RollingZ` is the detector (OLMo-core's practice: a value more than `threshold` standard
deviations above the mean of the last `window` values is a spike; the check stays off until the
window holds `min_history` values). `scan` runs it over a finished run's history.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from trainplan.config import GUARD_ACTIONS, GuardConfig
from trainplan.run.dist import full_tensor

# One source for the defaults: the config's (guard.window, guard.threshold, the actions).
WINDOW = GuardConfig.window
THRESHOLD = GuardConfig.threshold
ACTIONS = GUARD_ACTIONS  # in rising severity: across ranks the most severe wins


@dataclass
class RollingZ:
    window: int = WINDOW
    threshold: float = THRESHOLD
    min_history: int | None = None  # default: half the window
    values: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.min_history is None:
            self.min_history = max(2, self.window // 2)
        self.values = deque(self.values, maxlen=self.window)

    @property
    def active(self) -> bool:
        return len(self.values) >= self.min_history

    def zscore(self, value: float) -> float | None:
        """The value's z-score against the window, or None while the window is too short."""
        if not self.active:
            return None
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)
        # floor: a window of nearly equal values must not turn noise into a spike
        std = max(std, 1e-3 * abs(mean), 1e-12)
        return (value - mean) / std

    def observe(self, value: float) -> float | None:
        """z-score of `value`, then add it to the window (spikes and non-finite values are not added)."""
        if not math.isfinite(value):
            return math.inf
        z = self.zscore(value)
        if z is None or z <= self.threshold:
            self.values.append(value)
        return z

    def state_dict(self) -> dict:
        return {"window": self.window, "threshold": self.threshold, "values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = deque(state["values"], maxlen=self.window)


def scan(
    steps: list[dict],
    *,
    keys: tuple[str, ...] = ("loss", "grad_norm"),
    window: int = WINDOW,
    threshold: float = THRESHOLD,
    min_history: int | None = None,
    ignore: set[int] = frozenset(),
) -> dict:
    """Scan a run's per-step history: non-finite values, and spikes above `threshold` sigma.
    `ignore`: steps whose grad norm is not evidence (the fp16 GradScaler's own skips)."""
    events = []
    detectors = {k: RollingZ(window=window, threshold=threshold, min_history=min_history) for k in keys}
    for s in steps:
        for k, det in detectors.items():
            if k == "grad_norm" and s["step"] in ignore:
                continue
            value = float(s[k])
            z = det.observe(value)
            if not math.isfinite(value):
                events.append({"step": s["step"], "key": k, "value": value, "kind": "non-finite"})
            elif z is not None and z > threshold:
                events.append(
                    {
                        "step": s["step"],
                        "key": k,
                        "value": value,
                        "kind": "spike",
                        "z": round(z, 2),
                        "threshold": threshold,
                    }
                )
    checked = {k: max(0, len(steps) - (det.min_history or 0)) for k, det in detectors.items()}
    return {"events": events, "steps": len(steps), "z_checked_steps": checked, "window": window, "threshold": threshold}


class Guard:
    """The run's stability guard: one decision per optimizer step, before the update.

    Events: non-finite loss or gradient; loss or grad-norm spike (z-score against the rolling
    window, off until `min_history` values are in it); fp16 loss-scale collapse. Each event gets
    the action configured for its type (skip, rollback, stop). Values of applied steps enter the
    windows; the windows are part of the checkpoint so a resumed run decides the same way.
    """

    def __init__(self, cfg, *, scaler: bool) -> None:
        self.cfg = cfg
        self.scaler = scaler
        min_history = cfg.min_history or None
        self.loss = RollingZ(window=cfg.window, threshold=cfg.threshold, min_history=min_history)
        self.grad = RollingZ(window=cfg.window, threshold=cfg.threshold, min_history=min_history)
        self.events: list[dict] = []
        self.rollbacks = 0

    def check(self, step: int, loss: float, grad_norm: float, scale: float | None = None) -> dict | None:
        """The event at this step (with its action), or None: apply the update."""
        if not self.cfg.enabled:
            return None
        event = None
        if not math.isfinite(loss):
            event = {"kind": "non-finite", "key": "loss", "value": loss}
        elif not math.isfinite(grad_norm) and not self.scaler:  # with a GradScaler, inf grads are its business
            event = {"kind": "non-finite", "key": "grad_norm", "value": grad_norm}
        else:
            for key, det, value in (("loss", self.loss, loss), ("grad_norm", self.grad, grad_norm)):
                z = det.zscore(value) if math.isfinite(value) else None
                if z is not None and z > self.cfg.threshold:
                    event = {"kind": "spike", "key": key, "value": value, "z": round(z, 2)}
                    event["threshold"] = self.cfg.threshold
                    break
        if event is None and self.scaler and scale is not None and scale < self.cfg.min_loss_scale:
            event = {"kind": "scale-collapse", "key": "loss_scale", "value": scale}
            event["threshold"] = self.cfg.min_loss_scale
        if event is None:
            return None
        action = {
            "non-finite": self.cfg.on_nonfinite,
            "spike": self.cfg.on_spike,
            "scale-collapse": self.cfg.on_scale_collapse,
        }[event["kind"]]
        return {"step": step, **event, "action": action}

    def observe(self, loss: float, grad_norm: float) -> None:
        """Every finite value joins its window; a spike joins winsorized at mean + threshold x std.
        So a batch that is always unusual widens the window each time it comes back (its z-score
        falls), while one huge spike cannot mask the next one."""
        for det, value in ((self.loss, loss), (self.grad, grad_norm)):
            if not math.isfinite(value):
                continue
            z = det.zscore(value)
            if z is not None and z > self.cfg.threshold:
                n = len(det.values)
                mean = sum(det.values) / n
                value = mean + (value - mean) * self.cfg.threshold / z
            det.values.append(value)

    def state_dict(self) -> dict:
        return {"loss": list(self.loss.values), "grad_norm": list(self.grad.values), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.loss.values = deque(state["loss"], maxlen=self.cfg.window)
        self.grad.values = deque(state["grad_norm"], maxlen=self.cfg.window)
        self.rollbacks = state.get("rollbacks", 0)


class StepGuard:
    """The cross-rank decision of one optimizer step: apply, skip, roll back or stop.

    Every rank reaches the same decision: the values are global, and the action is reduced across
    ranks too (the most severe wins), so no rank steps while another skips. `step.train_step` calls
    it after the gradients are complete; the loop reads `loss` and `event` afterwards."""

    def __init__(self, guard: Guard, env) -> None:
        self.guard, self.env = guard, env
        self.step, self.batch_ids = 0, []
        self.loss: float = math.nan
        self.event: dict | None = None

    def begin(self, step: int, batch_ids: list[int]) -> None:
        self.step, self.batch_ids, self.loss, self.event = step, batch_ids, math.nan, None

    def __call__(self, loss_t, norm_t, scale: float | None) -> bool:
        env = self.env
        loss = float(env.data_sum(loss_t.float().cpu())) if env.world > 1 else float(loss_t)
        norm = float(full_tensor(norm_t))
        event = self.guard.check(self.step, loss, norm, scale)
        code = float(ACTIONS.index(event["action"]) + 1 if event else 0)
        code = int(env.all_reduce_max(_tensor(code))) if env.world > 1 else int(code)
        if code and event is None:  # another rank saw it
            event = {"step": self.step, "kind": "remote", "key": "-", "value": float("nan")}
        if code:
            event["action"] = ACTIONS[code - 1]
        self.guard.observe(loss, norm)
        if event is not None:
            event["batch_ids"] = env.gather(self.batch_ids)
        self.loss, self.event = loss, event
        return event is None


def _tensor(x: float):
    import torch

    return torch.tensor(x)
