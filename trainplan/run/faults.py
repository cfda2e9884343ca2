"""Fault injection, for tests: `guard.inject = ["nan-loss@5", "sigint@3", "kill-writing@4", ...]`.
The engine imports this module only when guard.inject is set (run/loop.py, run/checkpoint/manager.py),
so a product run carries none of it (tests/run/test_fault_injection.py checks)."""

from __future__ import annotations

import os
import signal

from trainplan import config as C


def schedule(cfg: C.GuardConfig) -> dict[int, list[str]]:
    """step -> the kinds injected at it, in the order listed (KIND@STEP listed twice fires on its replay too)."""
    out: dict[int, list[str]] = {}
    for item in cfg.inject:
        kind, _, at = item.partition("@")
        out.setdefault(int(at), []).append(kind)
    return out


def kill_at(cfg: C.GuardConfig, step: int) -> str | None:
    """The checkpoint-writer kill injected at `step` (one of config.KILL_KINDS), or None."""
    return next((k for k in schedule(cfg).get(step, ()) if k in C.KILL_KINDS), None)


class FaultInjection:
    """A loop callback: before each step, raise the signals a test asked for (Ctrl-C now; the last rank
    stopped, as a hung peer), and hand the step the numeric faults of this run of it (`Trainer.inject`)."""

    def __init__(self, cfg: C.GuardConfig) -> None:
        self.pending = schedule(cfg)

    def before_step(self, trainer, state) -> str | None:
        step = state.step + 1
        kinds = self.pending.get(step, ())
        if "sigint" in kinds:
            os.kill(os.getpid(), signal.SIGINT)
        if "hang" in kinds and trainer.env.rank == trainer.env.world - 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        trainer.inject = self.attempt(step)
        return None

    def attempt(self, step: int) -> tuple[str, ...]:
        """The faults injected into this run of `step`: one of each kind listed for it, so a kind listed
        twice (spike@6 twice) fires again when a rollback replays the step."""
        kinds = self.pending.get(step, [])
        now = tuple(dict.fromkeys(kinds))
        for kind in now:
            kinds.remove(kind)
        if not kinds:
            self.pending.pop(step, None)
        return now
