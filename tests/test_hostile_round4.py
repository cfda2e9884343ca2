"""Bad input, round four (issue 68): special files, data advise once accepted and train refused, garbage
weights, settings that set more than themselves, unknown GGUF versions, outputs named by their temporary
sibling, and refused runs that left files behind. The fuzz of each class is tests/hostile_gen.py's (run by
tests/test_hostile_files.py); these are the cases the issue names one by one, on real runs where it takes one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import hostile_gen
from tests.test_bad_input import _check
from trainplan import cli
from trainplan import config as C


def test_round_four_adds_at_least_sixty_generated_cases_across_its_classes():
    drawn = {name: n for name, n in hostile_gen.COUNTS.items() if name in hostile_gen.ROUND_FOUR}
    assert set(drawn) == set(hostile_gen.ROUND_FOUR) and sum(drawn.values()) >= 60
    assert set(hostile_gen.ROUND_FOUR) <= set(hostile_gen.CLASSES)


@pytest.fixture
def deadline():
    """Fails the test after 20 s instead of hanging the suite on a reader that opened a FIFO."""

    def expired(signum, frame):
        raise TimeoutError("a reader blocked (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["plan", "--model", "{fifo}", "--gpus", "cpu"], r"^model\.source: '.*fifo' is a FIFO"),
        (["plan", "{fifo}"], r"^config: '.*fifo' is a FIFO"),
        (["train", "--gpus", "cpu", "--set", "data.source={fifo}"], r"^data\.source: '.*fifo' is a FIFO"),
    ],
    ids=["model", "config", "data"],
)
def test_a_fifo_as_the_model_the_config_or_the_data_is_named_within_5_s(
    argv, pattern, tmp_path, capsys, monkeypatch, deadline
):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    _check([a.replace("{fifo}", str(fifo)) for a in argv], pattern, tmp_path, capsys, monkeypatch)
    assert time.monotonic() - t0 < 5


@pytest.fixture(scope="module")
def full_run(tiny_run, tmp_path_factory):
    """A real full fine-tune of the tiny model: its result/ holds real safetensors."""
    from trainplan.commands.train import execute

    root, base = tiny_run
    out = tmp_path_factory.mktemp("full") / "run"
    sets = [*base, "mode=full", "train.steps=1", "train.measure_memory=false", f"train.output_dir={out}"]
    execute(C.load(None, [*sets, "checkpoint.every=1"]), "off", quiet=True)
    return out


def test_exporting_a_run_whose_result_weights_are_garbage_is_refused_and_writes_nothing(
    full_run, tmp_path, capsys, monkeypatch
):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    weights = run / "result" / "model.safetensors"
    assert cli.main(["export", str(run), "-o", str(tmp_path / "fine")]) == 0  # the run as written exports
    capsys.readouterr()
    weights.write_bytes(os.urandom(weights.stat().st_size))  # the same size, random bytes
    out = tmp_path / "exported"
    _check(
        ["export", str(run), "-o", str(out)],
        r"^RUN_OR_CHECKPOINT: '.*model\.safetensors' is not a safetensors file trainplan can stand behind",
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert not out.exists()


def test_resuming_another_models_checkpoint_is_refused_before_the_run_writes_anything(
    full_run, tiny_run, tmp_path, capsys, monkeypatch
):
    from tests.conftest import TINY

    root, base = tiny_run
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps({**TINY, "intermediate_size": TINY["intermediate_size"] * 2}))
    step = full_run / "checkpoints" / "step-00000001"
    assert step.is_dir()
    sets = [s for s in base if not s.startswith("model.source")] + ["mode=full", f"model.source={wider}"]
    argv = ["train", *(x for s in sets for x in ("--set", s)), "--set", f"checkpoint.resume={step}"]
    _check(
        [*argv, "--output-dir", "out", "-q"],
        r"^checkpoint\.resume: step-00000001 was written for another model",
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_verify_resume_whose_inner_run_fails_says_so_in_one_line_and_leaves_no_workdir(tiny_run, tmp_path):
    root, base = tiny_run
    empty = tmp_path / "empty"
    empty.mkdir()
    sets = [s for s in base if not s.startswith("data.source")] + [f"data.source={empty}"]
    argv = [sys.executable, "-m", "trainplan", "verify-resume", "-q", "--steps", "3", "--at", "1"]
    argv += [*(x for s in sets for x in ("--set", s)), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-2000:]
    assert "run failed (uninterrupted, exit 2)" in lines[0]
    assert lines[0].endswith(f"data.source: '{empty}' holds no non-empty document; point it at real text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
