"""A trainplan process holds the cyclic garbage collector through its start-up (trainplan/startup.py):
the measured start-up is bench/startup.py's; these tests hold where the hold begins and ends."""

import gc
from pathlib import Path

import pytest

from trainplan import cli, startup
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
