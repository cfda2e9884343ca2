"""Instability detection: non-finite values and z-score spikes against a rolling window.

`RollingZ` is the detector (OLMo-core's practice: a value more than `threshold` standard
deviations above the mean of the last `window` values is a spike; the check stays off until the
window holds `min_history` values). `scan` runs it over a finished run's history.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WINDOW = 128
THRESHOLD = 6.0


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
) -> dict:
    """Scan a run's per-step history: non-finite values, and spikes above `threshold` sigma."""
    events = []
    detectors = {k: RollingZ(window=window, threshold=threshold, min_history=min_history) for k in keys}
    for s in steps:
        for k, det in detectors.items():
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
