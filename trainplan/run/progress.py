"""What a run tells the person watching it: a line as each stage starts and ends (load data,
tokenize, load weights, evaluate, train, save), training progress, and a heartbeat.

On a terminal, training is a tqdm bar. Elsewhere (a batch job's log) it is timestamped lines,
    2026-12-01 06:40:12 train step 40/200 loss 2.3100 lr 1.0e-04 grad 0.84 1.90 steps/s 1,234 tok/s eta 3m12s
one every `train.log_every` steps and one at least every `train.log_every_s` seconds of work:
at a step boundary when the interval has passed, and from a heartbeat thread when a stage or a
single step runs longer than that. Lines go through the `trainplan` logger, whose level
`--quiet` / `--verbose` set (commands/_common.py); `--verbose` adds a line for every step. Only
the main rank reports.

A run whose input is refused prints only its one-line error: lines are held until the run has
passed its checks (`commit()`, after set-up) and dropped if it fails first. A set-up longer than
`GRACE_S` (tokenizing a large corpus) releases them then, so the log still speaks every 30 s.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

LOG = logging.getLogger("trainplan")
GRACE_S = 30.0
HEARTBEAT_POLL_S = 1.0


def duration(seconds: float) -> str:
    """3.2s, 3m12s, 2h05m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Stage:
    """A running stage; `result` (set by its body) ends its closing line."""

    def __init__(self, name: str, t0: float) -> None:
        self.name, self.t0, self.result = name, t0, ""


class _Training:
    """Where training stands, for step lines, the ETA and the heartbeat."""

    def __init__(self, total: int, start: int, t0: float) -> None:
        self.total, self.start, self.t0 = total, start, t0
        self.step = start
        self.last_step, self.last_t, self.tokens = start, t0, 0  # since the last line


class Progress:
    """Stage lines, training progress and a heartbeat (see the module docstring).

    `clock` and `heartbeat=False` let a test drive time itself: `tick()` is the heartbeat's body."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        tty: bool | None = None,
        every_steps: int = 10,
        every_s: float = 30.0,
        grace_s: float = GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = LOG,
        heartbeat: bool = True,
    ) -> None:
        self.enabled = enabled and logger.isEnabledFor(logging.INFO)
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every_steps, self.every_s, self.grace_s = every_steps, every_s, grace_s
        self.clock, self.logger = clock, logger
        self._lock = threading.RLock()
        self._t0 = self._last_line = clock()
        self._held: list[logging.LogRecord] | None = [] if grace_s > 0 else None
        self._stages: list[Stage] = []
        self._training: _Training | None = None
        self._bar = None
        self._stop = threading.Event()
        self._thread = None
        if self.enabled and heartbeat:
            self._thread = threading.Thread(target=self._beat, name="trainplan-progress", daemon=True)
            self._thread.start()

    @classmethod
    def off(cls) -> Progress:
        return cls(enabled=False, heartbeat=False)

    @classmethod
    def for_config(cls, train_cfg, *, enabled: bool = True) -> Progress:
        """Reporting at a TrainConfig's log_every / log_every_s."""
        return cls(enabled=enabled, every_steps=train_cfg.log_every, every_s=train_cfg.log_every_s)

    # ---- lines ---------------------------------------------------------------------------

    def line(self, text: str, level: int = logging.INFO) -> None:
        """One line (a warning is never held back, and never dropped)."""
        if not (self.enabled or level >= logging.WARNING) or not self.logger.isEnabledFor(level):
            return
        record = self.logger.makeRecord(self.logger.name, level, __name__, 0, text, (), None)
        with self._lock:
            now = self.clock()
            self._last_line = now
            if self._held is not None and now - self._t0 < self.grace_s and level < logging.WARNING:
                self._held.append(record)
                return
            self._release()
            self.logger.handle(record)

    def commit(self) -> None:
        """The input was accepted: held lines go out, and no line is held from now on."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        for record in held or ():
            self.logger.handle(record)

    @contextlib.contextmanager
    def stage(self, name: str, doing: str = "") -> Iterator[Stage]:
        """`name ...` now and `name done in 3.2s: <result>` at the end (nothing more if it fails:
        the error is the line that matters)."""
        stage = Stage(name, self.clock())
        self.line(f"{name}: {doing} ..." if doing else f"{name} ...")
        with self._lock:
            self._stages.append(stage)
        try:
            yield stage
        finally:
            with self._lock:
                self._stages.remove(stage)
        took = duration(self.clock() - stage.t0)
        self.line(f"{name} done in {took}" + (f": {stage.result}" if stage.result else ""))

    # ---- training ------------------------------------------------------------------------

    @contextlib.contextmanager
    def training(self, total: int, start: int = 0) -> Iterator[Stage]:
        """The train stage; `step(entry)` reports each optimizer step within it."""
        with self.stage("train", f"steps {start + 1}-{total}" if start else f"{total} steps") as stage:
            with self._lock:
                self._training = _Training(total, start, self.clock())
            if self.enabled and self.tty:
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr, leave=False)
            try:
                yield stage
            finally:
                with self._lock:
                    bar, self._bar, self._training = self._bar, None, None
                if bar is not None:
                    bar.close()

    def step(self, entry: dict) -> None:
        """After an optimizer step (a loop record entry: step, loss, lr, grad_norm, tokens, memory)."""
        t = self._training
        if not self.enabled or t is None:
            return
        now = self.clock()
        with self._lock:
            t.step, t.tokens = entry["step"], t.tokens + entry["tokens"]
            if self._bar is not None:
                rate = entry["tokens_per_s"]
                self._bar.set_postfix_str(f"loss {entry['loss']:.4f} lr {entry['lr']:.1e} {rate:,.0f} tok/s", False)
                self._bar.update(entry["step"] - self._bar.n)
                return
            due = (
                t.step == t.start + 1
                or t.step == t.total
                or t.step % self.every_steps == 0
                or now - self._last_line >= self.every_s
            )
            if not due and not self.logger.isEnabledFor(logging.DEBUG):
                return
            text = self._step_text(t, entry, now)
            t.last_step, t.last_t, t.tokens = t.step, now, 0
        self.line(text, logging.INFO if due else logging.DEBUG)

    @staticmethod
    def _step_text(t: _Training, entry: dict, now: float) -> str:
        dt = max(now - t.last_t, 1e-9)
        eta = (now - t.t0) / max(1, t.step - t.start) * (t.total - t.step)
        text = (
            f"train step {t.step}/{t.total} loss {entry['loss']:.4f} lr {entry['lr']:.1e} "
            f"grad {entry['grad_norm']:.3g} {(t.step - t.last_step) / dt:.2f} steps/s {t.tokens / dt:,.0f} tok/s "
            f"eta {duration(eta)}"
        )
        memory = entry.get("memory") or {}  # the step's peak: the CUDA allocator's, or the process's RSS
        for key, label in (("max_allocated_bytes", "peak alloc"), ("max_rss_bytes", "peak rss")):
            if memory.get(key):
                text += f" {label} {memory[key] / 2**30:.2f} GiB"
                break
        return text + (" (update skipped)" if entry.get("skipped") else "")

    # ---- heartbeat -----------------------------------------------------------------------

    def tick(self) -> None:
        """Release held lines once the grace period is over; if nothing was printed for every_s
        seconds while a stage runs (outside a terminal's bar), say what is still running."""
        with self._lock:
            now = self.clock()
            if self._held is not None and now - self._t0 >= self.grace_s:
                self._release()
            if not self._stages or self._bar is not None or now - self._last_line < self.every_s:
                return
            stage, t = self._stages[-1], self._training
            text = f"{stage.name}: still running, {duration(now - stage.t0)} so far"
            if t is not None and stage.name == "train":
                text += f" (step {t.step + 1}/{t.total} for {duration(now - t.last_t)})"
        self.line(text)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_POLL_S):
            self.tick()

    def close(self, ok: bool = True) -> None:
        """Stop the heartbeat; held lines are printed if the run succeeded, dropped if it failed."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if ok:
                self._release()
            self._held = None
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(ok=exc_type is None)
