"""Progress where people look: stage and step lines (a time floor outside a terminal), --quiet,
TensorBoard event files, the metrics loggers' refusals, and accept's per-check stages."""

import argparse
import contextlib
import io
import itertools
import logging
import re
import sys

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.commands import _common
from trainplan.commands.train import execute
from trainplan.errors import ConfigError
from trainplan.run.progress import Progress

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
_names = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Lines(logging.Handler):
    """Each line with the (fake) clock's time when it came out."""

    def __init__(self, clock) -> None:
        super().__init__()
        self.clock, self.lines = clock, []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.clock(), record.getMessage()))


def reporter(clock, *, level=logging.INFO, **kwargs):
    logger = logging.getLogger(f"progress-test-{next(_names)}")
    logger.propagate, handler = False, Lines(clock)
    logger.addHandler(handler)
    logger.setLevel(level)
    kwargs = {"tty": False, "grace_s": 0, "heartbeat": False, **kwargs}
    return Progress(clock=clock, logger=logger, **kwargs), handler.lines


def entry(step: int) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.8, "tokens": 1000, "tokens_per_s": 100.0}


@pytest.fixture(autouse=True)
def _trainplan_logger():
    """The CLI configures the `trainplan` logger; leave it as it was for the next test."""
    logger = logging.getLogger("trainplan")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def test_a_line_at_least_every_interval_of_work_whatever_log_every_says():
    """Steps of 7 s with log_every far away: a step line as soon as 30 s passed since the last
    line (never more than one step late), and the first and last steps."""
    clock = Clock()
    progress, lines = reporter(clock, every_steps=1000, every_s=30)
    with progress.training(total=40):
        for step in range(1, 41):
            clock.t += 7
            progress.step(entry(step))
    steps = [(t, int(re.match(r"train step (\d+)/40 ", text)[1])) for t, text in lines if text.startswith("train step")]
    assert [s for _, s in steps] == [1, 6, 11, 16, 21, 26, 31, 36, 40]
    assert all(b - a <= 30 + 7 for (a, _), (b, _) in itertools.pairwise(steps))
    first = next(text for _, text in lines if text.startswith("train step 1/40"))
    assert re.fullmatch(r"train step 1/40 loss 2\.5000 lr 1\.0e-04 grad 0\.8 0\.14 steps/s 143 tok/s eta 4m33s", first)


def test_the_heartbeat_speaks_within_a_step_longer_than_the_interval():
    """One step of 100 s: the heartbeat (ticking each second, as its thread does) says what is
    running at most 30 s after the last line."""
    clock = Clock()
    progress, lines = reporter(clock, every_steps=1000, every_s=30)
    with progress.training(total=3):
        for step in (1, 2, 3):
            for _ in range(100 if step == 2 else 1):
                clock.t += 1
                progress.tick()
            progress.step(entry(step))
    times = [0.0] + [t for t, _ in lines]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 30
    beats = [text for _, text in lines if "still running" in text]
    assert beats[0] == "train: still running, 31.0s so far (step 2/3 for 30.0s)" and len(beats) == 3


def test_every_log_every_steps_and_each_step_when_verbose():
    clock = Clock()
    progress, lines = reporter(clock, every_steps=10, every_s=30)
    verbose, all_lines = reporter(clock, every_steps=10, every_s=30, level=logging.DEBUG)
    for p in (progress, verbose):
        with p.training(total=25):
            for step in range(1, 26):
                clock.t += 0.5
                p.step(entry(step))
    shown = [text.split()[2] for _, text in lines if text.startswith("train step")]
    assert shown == ["1/25", "10/25", "20/25", "25/25"]
    assert len([text for _, text in all_lines if text.startswith("train step")]) == 25


def test_lines_of_a_run_that_fails_in_its_first_seconds_are_dropped():
    """A refused input prints only its error: lines wait out the grace period, and go only if
    the run is still alive (or has succeeded)."""
    clock = Clock()
    failed, failed_lines = reporter(clock, grace_s=5)
    with pytest.raises(ConfigError), failed:
        with failed.stage("load data"):
            raise ConfigError("data.source", "bad", "fix it")
    assert failed_lines == []
    slow, slow_lines = reporter(clock, grace_s=5)
    with slow.stage("load weights"):
        assert slow_lines == []
        clock.t += 6
        slow.tick()
        assert [text for _, text in slow_lines] == ["load weights ..."]
    checked, checked_lines = reporter(clock, grace_s=30)
    with checked.stage("tokenize"):
        pass
    assert checked_lines == []
    checked.commit()  # the run passed its checks: held lines go out, later ones are not held
    checked.line("evaluate ...")
    assert [text for _, text in checked_lines] == ["tokenize ...", "tokenize done in 0.0s", "evaluate ..."]
    quick, quick_lines = reporter(clock, grace_s=5)
    with quick:
        with quick.stage("load data", "corpus") as stage:
            stage.result = "6 documents"
    assert [text for _, text in quick_lines] == ["load data: corpus ...", "load data done in 0.0s: 6 documents"]


@pytest.fixture(scope="module")
def logged_run(tiny_run, tmp_path_factory):
    """A tiny real run, logging as `trainplan train` does, with stderr not a terminal."""
    root, base = tiny_run
    out = tmp_path_factory.mktemp("logged")
    cfg = C.load(None, [*base, f"train.output_dir={out}", "train.steps=4", "train.log_every=3", "train.eval_every=2"])
    logger = logging.getLogger("trainplan")
    saved = logger.handlers[:], logger.level, logger.propagate
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # as cli.main does
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            _common.setup_logging(argparse.Namespace(quiet=False, verbose=False))
            record = execute(cfg)[0].to_json()
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    return stderr.getvalue(), out, record


def test_a_run_outside_a_terminal_prints_timestamped_stage_and_step_lines(logged_run):
    text, _, _ = logged_run
    lines = text.splitlines()
    assert lines and all(re.match(STAMP + " ", line) for line in lines), text
    body = [line[20:] for line in lines]
    for stage in ("load data", "tokenize", "load weights", "evaluate", "train", "save"):
        assert any(b.startswith(f"{stage}: ") or b == f"{stage} ..." for b in body), (stage, text)
        assert any(b.startswith(f"{stage} done in ") for b in body), (stage, text)
    steps = [b for b in body if b.startswith("train step")]
    assert [s.split()[2] for s in steps] == ["1/4", "3/4", "4/4"], text  # log_every=3, and the last
    line = r"loss \d+\.\d{4} lr 1\.0e-03 grad \S+ [\d.]+ steps/s [\d,]+ tok/s eta \S+ peak rss \d+\.\d\d GiB"
    assert all(re.fullmatch(r"train step \d/4 " + line, s) for s in steps), steps
    assert any(b.startswith("tokenize done in ") and "training and" in b for b in body)


def test_tensorboard_event_files_hold_the_run_scalars(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, record = logged_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "memory/max_rss_gib"} <= tags
    assert {"eval/loss", "eval/perplexity", "eval/token_accuracy"} <= tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([s["loss"] for s in record["steps"]], rel=1e-6)
    held_out = events.Scalars("eval/loss")  # before, at eval_every=2, and after
    assert [e.step for e in held_out] == [0, 2, 4]
    assert held_out[0].value == pytest.approx(record["eval_before"]["loss"], rel=1e-6)
    assert held_out[-1].value == pytest.approx(record["eval_after"]["loss"], rel=1e-6)


def test_quiet_prints_no_progress_and_report_to_none_writes_no_event_files(tiny_run, tmp_path, capsys):
    root, base = tiny_run
    out = tmp_path / "out"
    sets = [x for item in [*base, "train.steps=2", "train.report_to=none"] for x in ("--set", item)]
    code = cli.main(["train", *sets, "--output-dir", str(out), "--registry", "off", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    assert "held-out loss" in captured.out  # the result is still printed
    assert (out / "record.json").is_file() and not (out / "tensorboard").exists()


def test_an_unknown_logger_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^train\.report_to: unknown value 'tensorbord'; did you mean 'tensorboard'"):
        C.load(None, ['train.report_to=["tensorbord"]'])
    with pytest.raises(ConfigError, match=r'^train\.report_to: "none" with other loggers'):
        C.load(None, ['train.report_to=["none", "wandb"]'])
    assert C.load(None, ["train.report_to=wandb"]).train.report_to == ["wandb"]


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_a_logger_whose_package_is_missing_is_refused_before_the_run(tiny_run, tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed, whether it is or not
    root, base = tiny_run
    out = tmp_path / "out"
    cfg = C.load(None, [*base, f"train.output_dir={out}", f'train.report_to=["tensorboard", "{package}"]'])
    with pytest.raises(ConfigError, match=rf"^train\.report_to: '{package}' needs .*; pip install {package}, or"):
        execute(cfg)
    assert not out.exists()  # nothing half-written


def test_accept_reports_each_check_as_it_runs_and_how_long_it_took(tiny_run, tmp_path):
    from trainplan.verify import accept

    root, base = tiny_run
    clock = Clock()
    progress, lines = reporter(clock)
    cfg = C.load(accept.DEFAULT_CONFIG, [*base, "mode=inference"])
    result = accept.accept(cfg, out_dir=tmp_path, progress=progress)
    text = [t for _, t in lines]
    starts = [t for t in text if re.match(r"accept \[\d/6\] \w+: .* \.\.\.$", t)]
    assert [s.split()[1:3] for s in starts] == [
        ["[1/6]", "contract:"],
        ["[2/6]", "memory:"],
        ["[3/6]", "step:"],
        ["[4/6]", "quality:"],
        ["[5/6]", "resume:"],
        ["[6/6]", "instability:"],
    ]
    assert starts[0] == "accept [1/6] contract: the measured run, inference ..."
    first = text.index(starts[0])
    done = next(i for i, t in enumerate(text) if t.startswith("accept [1/6] contract done"))
    assert any(t.startswith("load weights") for t in text[first:done])  # the run's own stages, inside the check
    step_done = next(t for t in text if "[3/6] step done" in t)
    assert re.fullmatch(r"accept \[3/6\] step done in \d+\.\ds: n/a - .*", step_done)
    assert all(c["seconds"] >= 0 for c in result["checks"])
