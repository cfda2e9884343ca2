"""A trainplan process holds the cyclic garbage collector through its start-up (trainplan/startup.py):
the measured start-up is bench/startup.py's; these tests hold where the hold begins and ends."""

import gc
import os
from pathlib import Path

import pytest

from trainplan import cli, startup
from trainplan.commands import _common as common
from trainplan.run import loop


@pytest.fixture
def freezes(monkeypatch):
    """The calls of gc.freeze (each still freezes): the number of objects frozen is no measure, since a
    frozen object freed by its reference count leaves the count."""
    calls = []
    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: calls.append(gc.isenabled()) or freeze())
    return calls


@pytest.fixture
def held(freezes):
    """startup.hold() as a process's entry calls it; afterwards the collector runs again."""
    assert gc.isenabled() and not startup._held
    startup.hold()
    try:
        yield freezes
    finally:
        startup._held = False
        gc.enable()


def test_train_collects_nothing_until_its_model_is_built_then_freezes_what_start_up_made(
    tiny_run, tmp_path, monkeypatch, held
):
    seen = []
    prepare = loop.prepare

    def watched(*args, **kwargs):
        seen.append(("prepare", gc.isenabled(), len(held)))
        return prepare(*args, **kwargs)

    monkeypatch.setattr(loop, "prepare", watched)
    evaluate = loop.Trainer.evaluate
    monkeypatch.setattr(
        loop.Trainer,
        "evaluate",
        lambda self, **kw: seen.append(("evaluate", gc.isenabled(), len(held))) or evaluate(self, **kw),
    )
    _, base = tiny_run
    sets = [*base, "train.steps=1", "train.eval_batches=1", f"train.output_dir={tmp_path}"]
    sets = [x for s in sets for x in ("--set", s)]
    assert cli.main(["train", "--registry", "off", "-q", *sets]) == 0
    # held through the build, frozen once (while still held) and collecting from the first evaluation on
    assert seen[:2] == [("prepare", False, 0), ("evaluate", True, 1)]
    assert held == [False] and gc.isenabled() and not startup._held


def test_every_other_command_collects_from_the_start_of_its_run(monkeypatch, held):
    """Only train and accept hold the collector into their run (until loop.run has built the model);
    a plan, an advise or the planner's server collect as usual from their first line."""
    from trainplan.commands import plan

    seen = []
    run = plan.run
    monkeypatch.setattr(plan, "run", lambda args: seen.append((gc.isenabled(), len(held))) or run(args))
    assert cli.main(["plan", "--model", "tiny-llama", "--gpus", "cpu", "--json"]) == 0
    assert seen == [(True, 1)]


def test_an_advise_search_pauses_collection_and_resumes_it(monkeypatch, capsys, tmp_path):
    """The search plans with the collector off (startup.paused) and turns it back on, even when the
    search fails; a collector that was off before stays off."""
    from trainplan.advise import search

    seen = []
    climb = search._climb
    monkeypatch.setattr(search, "_climb", lambda *a: seen.append(gc.isenabled()) or climb(*a))
    assert cli.main(["advise", "tiny-llama", "--gpus", "cpu", "--seq", "64"]) == 0
    assert seen and not any(seen) and gc.isenabled()
    monkeypatch.setattr(search, "_climb", lambda *a: 1 / 0)
    monkeypatch.setenv("HOME", str(tmp_path))  # the internal error's traceback file goes there
    assert cli.main(["advise", "tiny-llama", "--gpus", "cpu", "--seq", "64"]) == 4  # an internal error
    assert gc.isenabled()
    capsys.readouterr()
    gc.disable()
    try:
        with startup.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_main_in_a_test_process_leaves_the_collector_alone(freezes, capsys):
    assert cli.main(["plan", "--model", "tiny-llama", "--gpus", "cpu", "--json"]) == 0
    assert gc.isenabled() and freezes == []


def test_the_process_entry_holds_the_collector_and_freezes_at_exit(monkeypatch, freezes):
    """`trainplan` and `python -m trainplan` start through cli.entry (pyproject's script, __main__)."""
    seen = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(gc.isenabled()) or 0)
    try:
        assert cli.entry() == 0
        assert seen == [False] and freezes == [False]  # held in main; frozen for the exit
    finally:
        startup._held = False
        gc.enable()
    package = Path(cli.__file__).parent
    assert "entry()" in (package / "__main__.py").read_text()
    assert 'trainplan = "trainplan.cli:entry"' in (package.parent / "pyproject.toml").read_text()


QUIETED = """
import argparse, sys
from trainplan.commands import _common
_common.setup_logging(argparse.Namespace(verbose=False, quiet=False))
loaded = [m for m in ("transformers", "huggingface_hub", "torch") if m in sys.modules]
from transformers.utils import logging
from huggingface_hub import utils
print(loaded, logging.get_verbosity() == logging.ERROR, logging.is_progress_bar_enabled(),
      utils.are_progress_bars_disabled())
"""


@pytest.mark.multiprocess
def test_quieting_the_libraries_imports_none_of_them_and_quiets_them_once_imported():
    """setup_logging's quiet_libraries (train, accept, verify-resume) imports neither transformers nor
    torch: verify-resume's parent, which loads no model, pays nothing for them; each, imported later,
    reads the quiet settings (ERROR, no progress bars)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in common.QUIET_ENVIRONMENT}
    r = subprocess.run([sys.executable, "-c", QUIETED], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", "True", "False", "True"]


def test_quieting_a_process_that_imported_transformers_already_uses_its_switches(monkeypatch):
    from transformers.utils import logging

    for name in common.QUIET_ENVIRONMENT:  # restored after the test, as quiet_libraries sets them
        monkeypatch.delenv(name, raising=False)
    before = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_warning()
    logging.enable_progress_bar()
    try:
        common.quiet_libraries()
        assert logging.get_verbosity() == logging.ERROR and not logging.is_progress_bar_enabled()
        assert not any(name in os.environ for name in common.QUIET_ENVIRONMENT)  # nothing for the children
    finally:
        logging.set_verbosity(before[0])
        (logging.enable_progress_bar if before[1] else logging.disable_progress_bar)()
