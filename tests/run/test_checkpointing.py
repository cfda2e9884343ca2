"""Activation checkpointing as a continuum (issue 20): the first N layers, or "auto", the fewest that
fit a budget. The engine checkpoints exactly those layers, the losses stay bitwise those of the
plain run, the plan matches the measured step, and auto's choice runs under its budget."""

import json

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.errors import ConfigError
from trainplan.plan import analytic
from trainplan.verify.checks import check_memory

torch = pytest.importorskip("torch")

# four layers, so that "auto" has room between none and every layer; LoRA with the fused loss, so
# that the layers' activations, not the 49k-token vocabulary, make the peak
FOUR = ["batch.seq_len=256", "batch.micro_batch_size=8", "mode=lora", "train.steps=2", "hardware.cpu_runtime_mib=0"]


@pytest.fixture(scope="module")
def four_layers(tiny_run, tmp_path_factory):
    root, base = tiny_run
    config = json.loads((root / "config.json").read_text())
    d = tmp_path_factory.mktemp("four")
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4, "intermediate_size": 256}))
    return [*(s for s in base if not s.startswith("model.source=")), f"model.source={d / 'config.json'}", *FOUR]


def train(settings, out, *extra):
    cfg = C.load(None, [*settings, "train.eval_batches=1", f"train.output_dir={out}", *extra])
    return execute(cfg, quiet=True)[0]


def test_the_engine_checkpoints_exactly_the_first_n_layers(tiny_run):
    from transformers.modeling_layers import GradientCheckpointingLayer

    from trainplan.resolve import resolve
    from trainplan.run.build import build_model

    root, base = tiny_run
    for setting, want in (("1", [True, False]), ("true", [True, True]), ("false", [False, False])):
        r = resolve(C.load(None, [*base, f"memory.activation_checkpointing={setting}"]))
        model = build_model(r.spec, r.cfg, r.precision)
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert [m.gradient_checkpointing for m in layers] == want, setting


def test_checkpointing_changes_nothing_but_memory(tiny_run, tmp_path):
    """fp32 on the CPU: none, the first layer, every layer, every layer selectively: the same losses
    and weights, bit for bit."""
    root, base = tiny_run
    settings = {"false": [], "1": [], "true": [], "selective": ["memory.checkpointing_policy=selective"]}
    runs = {
        name: train(
            base,
            tmp_path / name,
            f"memory.activation_checkpointing={'true' if name == 'selective' else name}",
            "train.measure_memory=false",
            *extra,
        ).to_json()
        for name, extra in settings.items()
    }
    history = {ac: [(s["loss"], s["grad_norm"]) for s in rec["steps"]] for ac, rec in runs.items()}
    assert history["1"] == history["false"] == history["true"] == history["selective"]
    hashes = {ac: rec["final"]["weights_hash"] for ac, rec in runs.items()}
    assert hashes["1"] == hashes["false"] == hashes["true"] == hashes["selective"]


def test_partial_checkpointing_plan_matches_the_measured_step(four_layers, tmp_path):
    """The first 2 of 4 layers: every device's phases within 5 % of the measured peak, as accept checks,
    and the bill falls between none's and every layer's."""
    record = train(four_layers, tmp_path, "memory.activation_checkpointing=2")
    ledger = analytic.plan(C.from_dict(record.config))
    check = check_memory(record, ledger, 0.05)
    assert check.passed, check.summary
    peak = {ac: analytic.plan(C.load(None, [*four_layers, f"memory.activation_checkpointing={ac}"])) for ac in (0, 4)}
    bills = [peak[0].devices[0].total_bytes, ledger.devices[0].total_bytes, peak[4].devices[0].total_bytes]
    assert bills[0] > bills[1] > bills[2], bills


def test_auto_chooses_the_fewest_layers_under_the_budget_and_the_run_stays_under_it(four_layers, tmp_path, capsys):
    bill = {
        n: analytic.plan(C.load(None, [*four_layers, f"memory.activation_checkpointing={n}"])).devices[0].total_bytes
        for n in range(5)
    }
    assert all(bill[n] > bill[n + 1] for n in range(4)), bill  # each checkpointed layer saves memory
    budget = (bill[1] + bill[2]) // 2  # 1 layer is over, 2 fit
    settings = [*four_layers, f"hardware.memory_budget={budget / 2**20:.4f}MiB", "memory.activation_checkpointing=auto"]
    ledger = analytic.plan(C.load(None, settings))
    assert ledger.settings["activation_checkpointing"] == 2 and ledger.fits
    assert any(n.startswith("activation checkpointing auto: 2 of 4 layers, the fewest that fit") for n in ledger.notes)

    record = train(settings, tmp_path)
    assert "activation checkpointing auto: 2 of 4 layers" in capsys.readouterr().err
    assert record.config["memory"]["activation_checkpointing"] == 2  # the record holds the choice
    (rank,) = record.memory["per_rank"]
    assert rank["peak_bytes"] <= ledger.devices[0].budget_bytes  # the measured peak, under the budget
    check = check_memory(record, analytic.plan(C.from_dict(record.config)), 0.05)
    assert check.passed, check.summary
    (proof,) = check.evidence["budget"]  # accept's memory check proves the budget on the run
    assert (
        proof["ok"]
        and proof["measured_bill"] == rank["peak_bytes"]
        and proof["budget"] == ledger.devices[0].budget_bytes
    )
    assert "every device under hardware.memory_budget" in check.summary
    # the same run against a budget it exceeds: the check fails, and says by how much
    tight = analytic.plan(
        C.from_dict({**record.config, "hardware": {**record.config["hardware"], "memory_budget": "1MiB"}})
    )
    failed = check_memory(record, tight, 0.05)
    assert not failed.passed and "1 of 1 devices over hardware.memory_budget" in failed.summary


def test_auto_says_none_when_the_run_fits_and_every_layer_when_nothing_does(four_layers):
    fits = analytic.plan(C.load(None, [*four_layers, "memory.activation_checkpointing=auto"]))
    assert fits.settings["activation_checkpointing"] is False
    assert any(n.startswith("activation checkpointing auto: none; the run fits without it") for n in fits.notes)
    tiny = analytic.plan(
        C.load(None, [*four_layers, "memory.activation_checkpointing=auto", "hardware.memory_budget=1MiB"])
    )
    assert tiny.settings["activation_checkpointing"] is True and not tiny.fits
    assert "(hardware.memory_budget)" in tiny.verdict()


@pytest.mark.parametrize(
    "setting, message",
    [
        ('"sometimes"', "memory.activation_checkpointing: unknown value 'sometimes'"),
        ("-1", "memory.activation_checkpointing: unknown value -1"),
        ("9", "memory.activation_checkpointing: 9 layers, but"),
    ],
)
def test_bad_checkpointing_values_are_one_line_errors(four_layers, setting, message, capsys):
    code = cli.main(
        ["plan", *(x for s in [*four_layers, f"memory.activation_checkpointing={setting}"] for x in ("--set", s))]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"trainplan plan: error: {message}") and "\n" not in err, err


def test_a_budget_without_a_unit_is_refused(four_layers):
    with pytest.raises(ConfigError, match="hardware.memory_budget: '20' has no unit"):
        analytic.plan(C.load(None, [*four_layers, 'hardware.memory_budget="20"']))


def test_selective_checkpointing_is_refused_where_it_is_not_planned(four_layers, capsys):
    code = cli.main(["plan", "Mixtral-8x7B", "--set", "memory.checkpointing_policy=selective", "--checkpointing"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "memory.checkpointing_policy: selective checkpointing is planned for dense layers" in err
    code = cli.main(["plan", *(x for s in [*four_layers, 'memory.checkpointing_policy="some"'] for x in ("--set", s))])
    assert code == 2 and "memory.checkpointing_policy: unknown value 'some'" in capsys.readouterr().err
    eager = [*four_layers, "memory.checkpointing_policy=selective", "memory.attention=eager"]
    assert cli.main(["plan", *(x for s in eager for x in ("--set", s))]) == 2
    assert "selective checkpointing is planned with SDPA attention" in capsys.readouterr().err
