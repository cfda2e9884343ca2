"""One verdict, one margin (plan/verdict.py): FITS when the headroom covers the margin (the plan's
accuracy band plus the caching allocator's reserve), TIGHT when only the tensors fit, DOES NOT FIT
when they do not. The same function answers plan, trace, advise and launch."""

from __future__ import annotations

import json

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.advise.search import search
from trainplan.commands.advise import request_from_args
from trainplan.plan import fragmentation
from trainplan.plan.analytic import plan
from trainplan.plan.verdict import DOES_NOT_FIT, FITS, TIGHT

BASE = {
    "model.source": "Llama-3.2-1B",
    "mode": "lora",
    "batch.micro_batch_size": 1,
    "batch.seq_len": 1024,
    "precision": "amp-bf16",
    "memory.activation_checkpointing": False,
}


def at_capacity(capacity_bytes: int, **extra):
    return plan(C.load(None, [], {**BASE, "hardware.gpus": "1x" + f"{capacity_bytes}B", **extra}))


@pytest.fixture(scope="module")
def bill():
    """(need, margin) of the base job: the same on any capacity (the bill does not read it)."""
    d = at_capacity(80 << 30).devices[0]
    return d.need_bytes, d.margin_bytes


@pytest.mark.parametrize(
    ("offset", "state", "code", "strict_code"),
    [
        ("need+margin", FITS, 0, 0),
        ("need+margin-1", TIGHT, 0, 1),
        ("need", TIGHT, 0, 1),
        ("need-1", DOES_NOT_FIT, 1, 1),
    ],
)
def test_the_three_states_at_their_boundaries(bill, offset, state, code, strict_code):
    need, margin = bill
    capacity = {"need+margin": need + margin, "need+margin-1": need + margin - 1, "need": need, "need-1": need - 1}
    ledger = at_capacity(capacity[offset])
    d = ledger.devices[0]
    assert (d.need_bytes, d.margin_bytes) == (need, margin)
    assert d.usable_bytes == capacity[offset]
    assert ledger.state == d.state == state
    assert ledger.exit_code_for() == code and ledger.exit_code_for(strict=True) == strict_code
    assert ledger.verdict().startswith(state)
    assert ledger.fits is (state == FITS)


def test_the_margin_is_the_accuracy_band_plus_the_allocator_reserve(bill):
    d = at_capacity(80 << 30).devices[0]
    fraction, source = fragmentation.reserve_fraction("lora", False, expandable=True)  # the default mode
    assert d.reserve_fraction == fraction and d.reserve_source == source
    assert d.margin_bytes == d.error_margin_bytes + int(fraction * d.peak_allocated)
    assert d.headroom_bytes == d.usable_bytes - d.need_bytes - d.margin_bytes
    margin = d.margin_json()
    assert margin["total_bytes"] == margin["accuracy_bytes"] + margin["allocator_bytes"] == d.margin_bytes
    assert "lora" in margin["allocator_source"]


def test_a_measured_class_keeps_its_own_reserve_and_the_setting_overrides_it():
    full = at_capacity(80 << 30, mode="full").devices[0]
    lora = at_capacity(80 << 30).devices[0]
    assert full.reserve_fraction == fragmentation.reserve_fraction("full", False, expandable=True)[0]
    assert full.reserve_fraction > lora.reserve_fraction  # full fine-tuning fragments more (H200 rows)
    fixed = at_capacity(80 << 30, **{"hardware.allocator_reserve": 0.01}).devices[0]
    assert fixed.reserve_fraction == 0.01 and fixed.reserve_source == "hardware.allocator_reserve"


def test_an_unmeasured_class_gets_the_widest_factor(monkeypatch):
    monkeypatch.setattr(fragmentation, "_factors", lambda expandable=False: ({"lora": 0.02, "full": 0.3}, "test"))
    fraction, why = fragmentation.reserve_fraction("inference", False)
    assert (fraction, why) == (0.3, "no inference rows: the widest class (test)")
    assert fragmentation.reserve_fraction("qlora", True)[0] == 0.3  # lora+ac: not measured here
    assert fragmentation.reserve_fraction("qlora", False)[0] == 0.02


def test_a_replay_miss_comes_from_its_class_and_an_unmeasured_class_gets_the_widest(monkeypatch):
    misses = {"lora+ac": (0.057, "row 13"), "full": (0.0001, "row 6")}
    monkeypatch.setattr(fragmentation, "_misses", lambda: (misses, "test"))
    assert fragmentation.replay_miss("qlora", True) == (0.057, "the replay's worst lora+ac miss (row 13; test)")
    assert fragmentation.replay_miss("full", False)[0] == 0.0001
    fraction, why = fragmentation.replay_miss("inference", False)
    assert (fraction, why) == (0.057, "no inference rows: the widest class's miss (row 13; test)")


def test_plan_prints_tight_with_the_margins_parts_and_strict_exits_1(bill, capsys):
    need, margin = bill
    settings = [a for k, v in BASE.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    argv = ["plan", "--gpus", f"1x{need + margin // 2}B", *settings]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "TIGHT: may run out of memory" in out and "caching allocator" in out and "accuracy" in out
    assert cli.main([*argv, "--strict"]) == 1
    capsys.readouterr()
    assert cli.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["state"] == TIGHT and doc["verdict"]["fits"] is False
    assert doc["verdict"]["margin"]["total_bytes"] == margin
    assert doc["devices"][0]["need_bytes"] == need


def test_advise_counts_a_row_as_fitting_exactly_when_plan_says_fits():
    args = cli.build_parser().parse_args(["advise", "Llama-3.1-8B", "--gpus", "RTX4090", "--seq", "2048"])
    s = search(request_from_args(args))
    states = [(o.fits, o.base.state) for o in s.outcomes]
    assert any(fits for fits, _ in states) and any(not fits for fits, _ in states)
    for o in s.outcomes:
        assert o.base.fits is (o.base.state == FITS)
        if o.fits:
            assert o.ledgers[o.best_micro].state == FITS


DDP_OFFLOAD = ["--gpus", "2xH100-80GB", "--set", 'model.source="Llama-3.2-1B"', "--set", 'parallel.strategy="ddp"']
DDP_OFFLOAD += ["--set", "parallel.offload_optimizer=true", "--set", 'hardware.host_mem="512GiB"']


def test_a_layout_train_does_not_run_is_planned_and_says_so(capsys):
    assert cli.main(["plan", *DDP_OFFLOAD, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runnable"]["ok"] is False and doc["runnable"]["field"] == "parallel.offload_optimizer"
    assert "zero3" in doc["runnable"]["why"]  # the nearest layout that runs
    assert cli.main(["plan", *DDP_OFFLOAD]) == 0
    assert "PLAN ONLY: `trainplan train` does not run this layout" in capsys.readouterr().out
    assert cli.main(["plan", *DDP_OFFLOAD[:4], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runnable"] == {"ok": True, "why": ""}


def test_accept_refuses_a_plan_only_layout_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "acc"
    assert cli.main(["accept", *DDP_OFFLOAD, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.offload_optimizer" in err and "plan only" in err
    assert not out.exists()
