"""The stability guard: detection at the step, skip / rollback / stop, and agreement across ranks."""

import functools
import json
import math

import pytest
from conftest import torchrun_train

from trainplan import cli
from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.errors import EXIT_STOPPED, ConfigError
from trainplan.run import guard


def run(tiny_run, out, *extra):
    root, base = tiny_run
    cfg = C.load(None, [*base, "train.measure_memory=false", "train.eval_batches=1", f"train.output_dir={out}", *extra])
    record = execute(cfg, quiet=True)[0].to_json()
    return record


@pytest.fixture(scope="module")
def reference(tiny_run, tmp_path_factory):
    """Two clean steps: what the weights, optimizer and scheduler must still be after a skipped third."""
    return run(tiny_run, tmp_path_factory.mktemp("ref"), "train.steps=2")


def assert_skipped_at_3(record, reference, key):
    (event,) = record["guard"]["events"]
    assert (event["step"], event["key"], event["kind"], event["action"]) == (3, key, "non-finite", "skip")
    assert event["batch_ids"] and len(event["batch_ids"][0]) == 4  # the skipped batch, per rank
    assert record["steps"][2]["skipped"] and math.isnan(record["steps"][2]["loss" if key == "loss" else "grad_norm"])
    final, ref = record["final"], reference["final"]
    assert final["weights_hash"] == ref["weights_hash"]  # the step changed no weight
    assert final["optimizer_hash"] == ref["optimizer_hash"]  # nor the optimizer state
    assert final["scheduler_step"] == ref["scheduler_step"] == 2  # nor the LR schedule


@pytest.mark.parametrize(("inject", "key"), [("nan-loss", "loss"), ("nan-grad", "grad_norm")])
def test_injected_nan_is_caught_at_its_step_and_changes_nothing(tiny_run, tmp_path, reference, inject, key):
    record = run(tiny_run, tmp_path, "train.steps=3", f"guard.inject=['{inject}@3']")
    assert_skipped_at_3(record, reference, key)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_injected_nan_on_two_ranks(tiny_run, tmp_path, strategy):
    """DDP and FSDP: both ranks take the same decision; the skipped step changes nothing."""
    root, base = tiny_run

    def torchrun(out, *extra):
        items = [*base, "batch.micro_batch_size=2", f"parallel.strategy={strategy}", "train.measure_memory=false"]
        return torchrun_train(out, [*items, "train.eval_batches=1", *extra])

    ref = torchrun(tmp_path / "ref", "train.steps=2")
    # a NaN loss at step 3, a NaN gradient at step 4, in one run: each caught at its own step
    record = torchrun(tmp_path / "nan", "train.steps=4", "guard.inject=['nan-loss@3', 'nan-grad@4']")
    events = record["guard"]["events"]
    assert [(e["step"], e["key"], e["action"]) for e in events] == [(3, "loss", "skip"), (4, "grad_norm", "skip")]
    assert all(len(e["batch_ids"]) == 2 for e in events)  # the skipped sample ids of both ranks
    for k in ("weights_hash", "optimizer_hash", "scheduler_step"):  # the skipped steps changed nothing
        assert record["final"][k] == ref["final"][k], k


def test_every_injected_spike_is_detected(tiny_run, tmp_path):
    steps = [12, 15, 20, 23]
    record = run(
        tiny_run,
        tmp_path,
        "train.steps=24",
        "guard.window=16",
        "guard.inject=[" + ", ".join(f"'spike@{s}'" for s in steps) + "]",
    )
    events = record["guard"]["events"]
    assert [(e["step"], e["key"], e["kind"]) for e in events] == [(s, "loss", "spike") for s in steps]
    assert all(e["z"] > e["threshold"] == 6.0 for e in events)
    assert [s["step"] for s in record["steps"] if s.get("skipped")] == steps


@pytest.mark.slow
def test_no_false_positive_in_1000_clean_fine_tuning_steps(tiny_run, small_pretrained, tmp_path):
    """Fine-tuning a ready model, at the default threshold and window. (Training from random
    init is not clean in this sense: its early grad norms spike at 6-17 sigma, and the guard
    reports them.)"""
    record = run(
        tiny_run,
        tmp_path,
        f"model.source={small_pretrained}",
        "model.init=auto",
        "train.steps=1000",
        "batch.micro_batch_size=2",
        "optim.lr=1e-3",
    )
    assert len(record["steps"]) == 1000 and record["steps"][-1]["loss"] < record["steps"][0]["loss"]
    assert record["guard"]["events"] == []
    assert record["guard"]["settings"]["threshold"] == 6.0 and record["guard"]["settings"]["window"] == 128


def test_rollback_restores_the_checkpoint_skips_batches_and_completes(tiny_run, tmp_path):
    ck = tmp_path / "ck"
    record = run(
        tiny_run,
        tmp_path,
        "train.steps=8",
        f"checkpoint.dir={ck}",
        "checkpoint.every=4",
        "guard.on_nonfinite=rollback",
        "guard.rollback_skip=2",
        "guard.rollback_lr_factor=0.5",
        "guard.inject=['nan-loss@6']",
    )
    (event,) = record["guard"]["events"]
    assert event["action"] == "rollback" and event["restored_step"] == 4 and event["restored_from"] == "step-00000004"
    skipped = event["skipped_ids"]
    # the batches from the checkpoint through the bad step (5, 6), and rollback_skip = 2 more
    assert len(set(skipped)) == (6 - 4 + 2) * 4 and record["skipped_samples"] == skipped
    # steps 5-6 ran again after the rollback, and count once: their first runs are in the event
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [s["step"] for s in event["replaced_steps"]] == [5, 6]
    assert [s.get("replayed") for s in record["steps"]] == [None] * 4 + [1, 1, None, None]
    lrs = {s["step"]: s["lr"] for s in record["steps"]}
    assert lrs[7] == pytest.approx(0.5 * record["steps"][0]["lr"])  # the lowered LR
    assert record["contract"]["passed"]
    # the batches after the skipped ones are what the run trained on next
    assert not set(skipped) & set(record["final"]["next_batch"])


def test_stop_keeps_a_checkpoint_and_exits_non_zero(tiny_run, tmp_path, capsys):
    root, base = tiny_run
    ck = tmp_path / "ck"
    args = ["train"] + [
        x
        for item in [
            *base,
            "train.steps=5",
            f"train.output_dir={tmp_path}",
            f"checkpoint.dir={ck}",
            "checkpoint.every=0",
        ]
        + ["guard.on_nonfinite=stop", "guard.inject=['nan-grad@3']"]
        for x in ("--set", item)
    ]
    assert cli.main(args) == EXIT_STOPPED
    assert "stopped by the stability guard at step 3" in capsys.readouterr().out
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["stopped"]["step"] == 3 and len(record["steps"]) == 3
    state = json.loads((ck / "step-00000003" / "state.json").read_text())
    assert state["guard"]["loss"] == [s["loss"] for s in record["steps"]]  # the window travels with it
    # resuming from it continues with step 4
    resumed = run(tiny_run, tmp_path / "resumed", "train.steps=5", f"checkpoint.dir={ck}", "checkpoint.resume=auto")
    assert resumed["resume"]["step"] == 3 and [s["step"] for s in resumed["steps"]] == [4, 5]


def test_fp16_loss_scale_collapse_is_caught(tiny_run, tmp_path):
    """Repeated inf gradients halve the GradScaler's scale; below guard.min_loss_scale: stop. The
    skipped fp16 steps advance neither the optimizer nor the LR schedule."""
    record = run(
        tiny_run,
        tmp_path,
        "precision=amp-fp16",
        "train.steps=5",
        "guard.min_loss_scale=20000",  # 65536 -> 32768 -> 16384
        "guard.inject=['nan-grad@1', 'nan-grad@2']",
    )
    (event,) = record["guard"]["events"]
    assert (event["kind"], event["step"], event["action"]) == ("scale-collapse", 3, "stop")
    assert event["value"] == 16384.0
    assert [s.get("skipped", False) for s in record["steps"]] == [True, True, True]
    assert record["final"]["scheduler_step"] == 0


def test_rolling_z_is_off_until_half_full_and_ignores_spikes():
    det = guard.RollingZ(window=8, threshold=6.0)
    for v in (1.0, 1.1, 0.9):
        assert det.observe(v) is None  # 3 < 4 values: off
    det.observe(1.0)
    assert det.observe(10.0) > 6.0 and 10.0 not in det.values  # a spike does not enter the window
    assert det.observe(float("nan")) == math.inf


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("guard.on_spike='ignore'", "guard.on_spike: unknown value 'ignore'"),
        ("guard.inject=['nan@3']", "guard.inject: 'nan@3' is not KIND@STEP"),
        ("guard.threshold=0", "guard.threshold: must be a positive number"),
    ],
)
def test_guard_settings_are_validated(setting, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        C.load(None, [setting])


def test_a_recurring_unusual_batch_widens_the_window_but_a_new_spike_is_caught():
    """Spikes join the window winsorized at the threshold: a batch that is always unusual widens
    it each time it comes back (its z-score falls), while one huge spike cannot mask the next."""
    import random

    g = guard.Guard(C.load(None, ["guard.window=32"]).guard, scaler=False)
    rng = random.Random(0)
    zs = []
    for step in range(1, 401):
        loss = 1.5 if step % 20 == 0 else 1.0 + 0.01 * rng.random()
        event = g.check(step, loss, 1.0)
        if event:
            zs.append(event["z"])
        g.observe(loss, 1.0)
    assert len(zs) == 20 and all(a > b for a, b in zip(zs, zs[1:], strict=False)) and zs[-1] < zs[0] / 10
    assert g.check(401, 10.0, 1.0)["kind"] == "spike"
    g.observe(10.0, 1.0)
    assert g.check(402, 10.0, 1.0)["kind"] == "spike"  # the first spike did not mask the second


def test_rollback_never_uses_another_runs_checkpoint(tiny_run, tmp_path):
    """A stale, newer checkpoint in the same directory is never a rollback target: a fresh run is
    refused the directory of an earlier run, and one that continues it from step 4 explicitly rolls
    back to the checkpoint it resumed from, not to the newest in the directory (step 12)."""
    from trainplan.errors import ConfigError

    ck = tmp_path / "ck"
    common = [f"checkpoint.dir={ck}", "checkpoint.every=4", "checkpoint.keep_last=3"]
    run(tiny_run, tmp_path / "earlier", "train.steps=12", *common)  # leaves step-4, 8, 12
    guard_on = ["guard.on_nonfinite=rollback", "guard.inject=['nan-loss@6']"]
    with pytest.raises(ConfigError, match="holds another run's checkpoints"):
        run(tiny_run, tmp_path / "now", "train.steps=8", *common, *guard_on)
    record = run(
        tiny_run, tmp_path / "now", "train.steps=8", *common, *guard_on, f"checkpoint.resume={ck / 'step-00000004'}"
    )
    (event,) = record["guard"]["events"]
    assert event["restored_from"] == "step-00000004" and event["restored_step"] == 4
    assert [s["step"] for s in record["steps"]][-3:] == [6, 7, 8]


def test_accept_does_not_count_the_fp16_scalers_own_skips_as_instability():
    """amp-fp16: a step the GradScaler skipped for inf gradients is AMP at work, not a NaN."""
    from trainplan.run.record import RunRecord
    from trainplan.verify import checks as accept

    steps = [{"step": i, "loss": 2.0 - 0.01 * i, "grad_norm": 1.0} for i in range(1, 13)]
    steps[3] = {**steps[3], "grad_norm": math.inf, "skipped": True}
    config = {"precision": "amp-fp16", "mode": "full", "train": {"max_grad_norm": 1.0}}
    fields = {"versions": {}, "hardware": {}, "seed": 0, "data": {}, "model": {}, "batch": {}}
    record = RunRecord(config=config, steps=steps, **fields)
    assert accept.check_instability(record).passed
    config["precision"] = "fp32"  # without a GradScaler the same inf is an instability
    assert not accept.check_instability(record).passed


def test_a_second_rollback_skips_new_data_and_a_replay_counts_once(tiny_run, tmp_path, monkeypatch):
    """Issue 22: a spike at step 6, and another on the batch that replaced it (spike@6 twice).
    Each rollback restores step 5 and skips, by sample id, the batches from it through the bad step
    plus guard.rollback_skip more: the second skips new data, never the first's again. The replays
    count once. The final weights are bitwise those of a run that never saw the skipped samples."""
    from trainplan.run import data

    settings = ["train.steps=6", "guard.window=4", "guard.min_history=4", "guard.on_spike=rollback"]
    record = run(
        tiny_run,
        tmp_path / "rolled",
        *settings,
        f"checkpoint.dir={tmp_path / 'ck'}",
        "checkpoint.every=1",
        "guard.rollback_skip=1",
        "guard.inject=['spike@6', 'spike@6']",
    )
    first, second = record["guard"]["events"]
    for event in (first, second):
        assert (event["step"], event["kind"], event["action"]) == (6, "spike", "rollback")
        assert event["restored_from"] == "step-00000005"
        # the offending batch and rollback_skip = 1 more step's: 2 x 4 samples, none skipped twice
        (offending,) = event["batch_ids"]
        assert event["skipped_ids"][:4] == offending and len(set(event["skipped_ids"])) == 8
    assert not set(first["skipped_ids"]) & set(second["skipped_ids"])  # the second skipped new data
    assert record["skipped_samples"] == first["skipped_ids"] + second["skipped_ids"]
    # six steps in the record (the summary's count), step 6 by its third run; its first two are in the events
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4, 5, 6] and record["steps"][-1]["replayed"] == 2
    assert [s["step"] for s in first["replaced_steps"] + second["replaced_steps"]] == [6, 6]
    assert record["final"]["scheduler_step"] == 6
    state = json.loads((tmp_path / "ck" / "step-00000006" / "state.json").read_text())
    assert state["sampler"]["skipped"] == record["skipped_samples"]  # a resumed run keeps skipping them

    # a run whose sampler leaves those samples out from the start: no event, the same steps, bitwise
    skipped = record["skipped_samples"]
    monkeypatch.setattr(data, "StatefulSampler", functools.partial(data.StatefulSampler, exclude=skipped))
    clean = run(tiny_run, tmp_path / "clean", *settings)
    assert clean["guard"]["events"] == [] and clean["skipped_samples"] == skipped

    def history(r):
        return [(s["loss"], s["grad_norm"]) for s in r["steps"]]

    assert history(clean) == history(record)
    for key in ("weights_hash", "optimizer_hash", "next_batch", "scheduler_step"):
        assert clean["final"][key] == record["final"][key], key


def test_a_second_rollback_with_nothing_new_to_skip_stops(tiny_run, tmp_path, capsys):
    """train.overfit_batches: every step trains on the same batch, so a rollback has nothing to
    skip. The first one still replays (from step 3); a second one to the same checkpoint would
    train on the same data again, so the run stops (exit 3) with an event that says why."""
    root, base = tiny_run
    settings = [*base, "train.steps=4", f"train.output_dir={tmp_path}", "train.overfit_batches=1"]
    settings += [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=1", "guard.window=3", "guard.min_history=3"]
    settings += ["guard.on_spike=rollback", "guard.inject=['spike@4', 'spike@4']", "train.measure_memory=false"]
    assert cli.main(["train", *(x for item in settings for x in ("--set", item))]) == EXIT_STOPPED
    assert "stopped by the stability guard at step 4" in capsys.readouterr().out
    record = json.loads((tmp_path / "record.json").read_text())
    first, second = record["guard"]["events"]
    assert (first["action"], first["restored_from"], first["skipped_ids"]) == ("rollback", "step-00000003", [])
    assert second["action"] == "stop" and "restored_from" not in second
    assert second["note"].startswith("rolled back to step-00000003 before, and nothing new to skip since")
    assert record["stopped"]["step"] == 4 and [s["step"] for s in record["steps"]] == [1, 2, 3, 4]
    assert record["skipped_samples"] == []


def test_skipped_samples_are_left_out_on_every_rank_and_survive_a_restore():
    """The skip set is by sample id over the one global order, so 2 ranks together take what 1
    rank takes; loading an older state (a rollback's checkpoint) adds to it, never replaces it; a
    state written before skip sets existed (per-rank position, no ids) still loads."""
    from trainplan.run import data

    one = data.StatefulSampler(40, seed=1)
    before = one.state_dict()
    first = one.take_global(4)
    one.load_state_dict(before)  # restore the older position ...
    assert one.skip(first + first[:2]) == first and one.skipped == first  # each id once
    one.load_state_dict(before)  # ... whose state lacks the skipped ids: they stay skipped
    two = [data.StatefulSampler(40, seed=1, rank=r, world=2, exclude=first) for r in range(2)]
    taken = [s.take(8) for s in two]
    assert [i for pair in zip(*taken, strict=True) for i in pair] == one.take(16)
    assert not set(first) & set(one.take(40 - 20))  # through the end of the epoch: never drawn
    old = {"epoch": 0, "position": 3, "seed": 1, "n": 40, "world": 2}  # 6 samples consumed on 2 ranks
    fresh = data.StatefulSampler(40, seed=1)
    fresh.load_state_dict(old)
    assert fresh.take(1) == data.StatefulSampler(40, seed=1).take(7)[6:] and fresh.skipped == []


def test_fault_injection_is_a_callback_only_when_a_test_asks_for_it(tiny_run):
    """The loop body holds training only: fault injection (run/faults.py) is a callback the loop adds when
    guard.inject is set, and no engine module imports it at module level."""
    import ast
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from trainplan.resolve import resolve
    from trainplan.run import loop

    def kinds(*extra):
        cfg = C.load(None, [*tiny_run[1], *extra])
        trainer = SimpleNamespace(job=SimpleNamespace(cfg=cfg, resolved=resolve(cfg)))
        made = loop.Trainer.callbacks(trainer, loop.Interrupts(), None, None, 0, sampled=True)
        return [type(c).__name__ for c in made]

    assert "FaultInjection" not in kinds() and kinds()[0] == "Interruption"
    assert "FaultInjection" in kinds("guard.inject=['spike@2']")
    for module in ("trainplan.run.loop", "trainplan.run.checkpoint.manager", "trainplan.run.step"):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        top = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        assert not [t for t in top if "faults" in t], f"{module} imports fault injection at module level"
