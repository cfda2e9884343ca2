"""What the training loop does around a step, as callbacks (OLMo-core's `train/callbacks/` shape):
signals, the stability guard's verdicts, the evaluation cadence, checkpoints, progress and trackers,
`train.stop_after`, the compile time. The loop (run/loop.py `Trainer.train`) holds training only: it
asks each callback in order before a step and after it, and a callback answers STOP (end the loop),
REPLAY (a rollback: run the step again, the later callbacks skipped) or None.

A callback has any of before_step(trainer, state), after_step(trainer, state, entry) and
train_end(trainer, state); fault injection for tests is one more (run/faults.py), added only when
guard.inject is set."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from trainplan.errors import EXIT_STOPPED

if TYPE_CHECKING:
    from trainplan.run.checkpoint.manager import CheckpointManager
    from trainplan.run.guard import StepGuard
    from trainplan.run.loop import Interrupts, Trainer
    from trainplan.run.setup import TrainState

STOP, REPLAY = "stop", "replay"


class Interruption:
    """SIGINT / SIGTERM, agreed by every rank, stop the run at a step boundary, with a checkpoint of
    where it got to (when it got anywhere)."""

    def __init__(self, interrupts: Interrupts, ckpt: CheckpointManager, start: int) -> None:
        self.interrupts, self.ckpt, self.start = interrupts, ckpt, start

    def before_step(self, trainer: Trainer, state: TrainState) -> str | None:
        signum = self.interrupts.agreed(trainer.env)
        if not signum:
            return None
        if state.step > self.start:
            self.ckpt.save(state, force=True)
        trainer.record.interrupted = {"signal": signal.Signals(signum).name, "code": EXIT_STOPPED, "step": state.step}
        return STOP


class GuardVerdicts:
    """The stability guard's event of the step: reported; a rollback restores the last checkpoint and
    replays from it; a stop keeps a checkpoint and ends the run."""

    def __init__(self, guard: StepGuard, ckpt: CheckpointManager, *, sampled: bool) -> None:
        self.guard, self.ckpt, self.sampled = guard, ckpt, sampled

    def after_step(self, trainer: Trainer, state: TrainState, entry: dict) -> str | None:
        event = self.guard.event
        if event is None:
            return None
        rolled_back = event["action"] == "rollback" and self.ckpt.rollback(state, event, sampled=self.sampled)
        trainer.report(event)
        if rolled_back:
            event["replaced_steps"] = trainer.replay_from(state.step)
            return REPLAY
        if event["action"] == "stop":
            self.ckpt.save(state, force=True)
            trainer.record.stopped = event
            return STOP
        return None


class Evaluation:
    """The held-out metric every train.eval_every steps (the last step's is the run's final evaluation)."""

    def __init__(self, every: int, steps: int) -> None:
        self.every, self.steps = every, steps

    def after_step(self, trainer: Trainer, state: TrainState, entry: dict) -> None:
        if self.every and state.step % self.every == 0 and state.step < self.steps:
            entry["eval"] = trainer.evaluate()


class Checkpoints:
    """A checkpoint every checkpoint.every steps."""

    def __init__(self, ckpt: CheckpointManager) -> None:
        self.ckpt = ckpt

    def after_step(self, trainer: Trainer, state: TrainState, entry: dict) -> None:
        if self.ckpt.due(state.step):
            self.ckpt.save(state)


class Reporting:
    """The step's entry to the progress reporter and the metrics loggers."""

    def after_step(self, trainer: Trainer, state: TrainState, entry: dict) -> None:
        trainer.progress.step(entry)
        trainer.trackers.step(entry)


class StopAfter:
    """train.stop_after: end the run early at that step (a resumable stop, as a preemption)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, trainer: Trainer, state: TrainState, entry: dict) -> str | None:
        return STOP if state.step >= self.step else None


class CompileTime:
    """train.compile: the record's compile time, from the steps' times."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def train_end(self, trainer: Trainer, state: TrainState) -> None:
        trainer.record.compile = compile_time(self.layers, [s["seconds"] for s in trainer.record.steps])


def compile_time(layers: int, seconds: list[float]) -> dict:
    """train.compile in the record: torch.compile traces and compiles in the first step (the held-out
    evaluation before it compiled the no-grad graph, in its own time); what that step took beyond the
    median of the others is the training graph's compile time."""
    import statistics

    rest = seconds[1:]
    extra = seconds[0] - statistics.median(rest) if rest else None
    return {
        "backend": "inductor",
        "regions": f"each of the {layers} decoder layers",
        "seconds": extra,
        "method": "the first step's time beyond the median of the later steps",
    }


def ask(callbacks: list, hook: str, *args) -> str | None:
    """Call `hook` on each callback that has it, in order; the first answer (STOP, REPLAY) ends the asking."""
    for cb in callbacks:
        method = getattr(cb, hook, None)
        answer = method(*args) if method else None
        if answer:
            return answer
    return None


class LargestBatchProbe:
    """train.largest_batch_first: after the run's first step, once the optimizer state exists, the widest
    micro-batch's forward and backward (run/loop.py Trainer.probe_largest_batch)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def after_step(self, trainer: Trainer, state: TrainState, entry: dict) -> None:
        if state.step == self.start + 1 and trainer.record.largest_batch_probe is None:
            trainer.probe_largest_batch(state)
