"""`trainplan advise`: every answer follows from the analytic ledger of the configuration it names."""

import functools
import json
import math
import re
import sqlite3
import subprocess
import sys
import tomllib
from dataclasses import replace

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.advise import estimate, rank
from trainplan.advise.search import _step_backs, peak_fraction, search, why
from trainplan.commands.advise import request_from_args
from trainplan.plan.analytic import plan
from trainplan.plan.ledger import gib
from trainplan.resolve import resolve
from trainplan.spec.model import from_hf_config


@functools.cache
def advise(*argv):
    """(search, ranked outcomes) for `trainplan advise ARGV`, in process."""
    args = cli.build_parser().parse_args(["advise", *argv])
    s = search(request_from_args(args))
    return s, rank.ranked(s, args.prefer)


def replanned(s, outcome, micro_batch=None):
    """The ledger of an outcome's config, planned afresh from its TOML (no shared spec, no search state)."""
    cfg = outcome.rung.config(s.request.base, micro_batch or outcome.best_micro, s.request.global_batch)
    return plan(C.from_dict(tomllib.loads(C.to_toml(cfg))))


def step_back(s, outcome, adds):
    """The outcome of the rung one step down the ladder on knob `adds` (e.g. 'ZeRO-3/FSDP')."""
    rung = next(r for a, _, r in _step_backs(outcome.rung, s.devices) if a == adds)
    return s.by_rung[rung]


# ---- scenarios: the right answer follows from the ledger ---------------------------------------

SMALL = ("Llama-3.1-8B", "--gpus", "RTX4090", "--seq", "2048", "--global-batch", "16")
NODE_8B = ("Llama-3.1-8B", "--gpus", "8xH100-80GB", "--seq", "2048", "--global-batch", "64")
NODE_70B = ("Llama-3.1-70B", "--gpus", "8xH100-80GB", "--seq", "2048", "--global-batch", "64")


def test_8b_on_one_24gb_gpu_needs_lora_or_qlora():
    s, order = advise(*SMALL)
    top = order[0]
    assert top.rung.mode in ("lora", "qlora")
    assert replanned(s, top).fits
    full = [o for o in s.outcomes if o.rung.mode == "full"]
    assert full and not any(o.fits for o in full)
    for o in full:  # every full fine-tuning rung, even the leanest, overflows the one GPU
        assert not replanned(s, o, 1).fits
    assert top.estimate.step_s > 0 and top.estimate.tokens_per_s > 0
    line = why(top, s)
    assert line.startswith("LoRA needed: full fine-tuning exceeds GPU 0 by ")


def test_8b_on_8x80gb_is_full_finetuning_with_the_zero2_that_train_runs():
    """ZeRO-2 is on the ladder in the form `train` runs (FSDP2 grad-op), so it leads where it fits: until
    2026-12-06 the ladder held DeepSpeed's zero2, which fit but train refuses, and ZeRO-3 led instead."""
    s, order = advise(*NODE_8B)
    top = order[0]
    assert (top.rung.mode, top.rung.tp, top.rung.pp) == ("full", 1, 1)
    assert top.rung.strategy == "fsdp-grad-op" and top.rung.precision == "amp-bf16"
    assert rank.train_blocker(s, top) == ""  # train runs it
    ledger = replanned(s, top)
    assert ledger.fits and all(d.fits for d in ledger.devices) and len(ledger.devices) == 8
    # the rungs below it on the ladder do not fit: DDP and ZeRO-1 at any setting of this layout
    for strategy in ("ddp", "zero1"):
        rung = replace(top.rung, strategy=strategy)
        assert not replanned(s, s.by_rung[rung], 1).fits
    # the why line names the rung below, the device and the overflow the ledger shows
    below = step_back(s, top, "ZeRO-2 (FSDP2 grad-op)")
    assert below.rung.strategy == "zero1"
    failed = replanned(s, below, 1)
    assert not failed.fits
    worst = min(failed.devices, key=lambda d: d.headroom_bytes)  # ZeRO-1's uneven shares: not GPU 0
    assert f"exceeds {worst.label} by {gib(-worst.headroom_bytes)} (largest: {worst.largest_component}" in why(top, s)


def test_70b_on_8x80gb_is_full_with_fsdp_and_checkpointing_or_lora():
    s, order = advise(*NODE_70B)
    top = order[0]
    # full fine-tuning needs its states split 8 ways (ZeRO-3, or the tp split now that train runs it) and checkpointing
    assert top.rung.mode == "lora" or ((top.rung.strategy == "zero3" or top.rung.tp == 8) and top.rung.ac)
    assert replanned(s, top).fits
    if top.rung.mode == "full":
        assert not replanned(s, s.by_rung[replace(top.rung, ac=False)], 1).fits  # checkpointing was needed
        if top.rung.tp == 1:
            assert not replanned(s, s.by_rung[replace(top.rung, strategy="fsdp-grad-op")], 1).fits  # and so was ZeRO-3
        assert "checkpointing needed: no checkpointing exceeds GPU 0 by" in why(top, s)
    # mixed-precision AdamW full fine-tuning does not fit at all, whatever the layout
    assert not any(
        o.fits for o in s.outcomes if (o.rung.mode, o.rung.precision, o.rung.optimizer) == ("full", "amp-bf16", "adamw")
    )


def test_405b_inference_on_8x80gb_fails_per_device_and_says_what_would_fit(capsys):
    argv = ("Llama-3.1-405B", "--mode", "inference", "--gpus", "8xH100-80GB", "--seq", "2048", "--global-batch", "8")
    s, order = advise(*argv)
    assert order == []
    assert {o.rung.precision for o in s.outcomes} == {"bf16"}
    for o in s.outcomes:  # every layout overflows some device on its own
        ledger = replanned(s, o, 1)
        assert not ledger.fits and any(not d.fits for d in ledger.devices)
    assert cli.main(["advise", *argv]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the text wraps at 100 columns
    assert "NOTHING FITS: every candidate exceeds a device (memory does not pool)" in out
    assert "needs >= 16 x H100-80GB (inference, bf16, tp 8, pp 2), or 8 x H200-141GB (inference, bf16, tp 8)" in out
    # and what it says would fit does fit
    for gpus, pp in (("16xH100-80GB", 2), ("8xH200-141GB", 1)):
        cfg = C.load(
            None,
            [],
            {
                "model.source": "Llama-3.1-405B",
                "mode": "inference",
                "precision": "bf16",
                "hardware.gpus": gpus,
                "hardware.safety_margin": 0.05,
                "batch.seq_len": 2048,
                "batch.global_batch_size": 8,
                "parallel.tp": 8,
                "parallel.pp": pp,
            },
        )
        assert plan(cfg).fits


# ---- the search ------------------------------------------------------------------------------


def test_margin_is_kept_free_on_every_device():
    s, order = advise(*NODE_8B, "--margin", "0.05")
    assert all(d.usable_bytes == int(d.device.capacity_bytes * 0.95) for d in order[0].best.devices)
    loose, loose_order = advise(*NODE_8B)  # the default: no margin beyond the verdict's own
    assert all(d.usable_bytes == d.device.capacity_bytes for d in loose_order[0].best.devices)
    assert sum(o.fits for o in loose.outcomes) >= sum(o.fits for o in s.outcomes)


def test_micro_batch_is_the_largest_that_fits_and_the_next_does_not():
    s, order = advise(*SMALL)
    capped = [o for o in s.outcomes if o.over]
    assert capped
    for o in capped:
        assert replanned(s, o, o.largest_micro).fits
        assert not replanned(s, o, o.over[0]).fits
    assert s.evaluated > len(s.outcomes)  # micro-batches searched, each one a plan


def test_preferences_change_the_ranking():
    s, ladder = advise(*SMALL)
    _, speed = advise(*SMALL, "--prefer", "speed")
    _, memory = advise(*SMALL, "--prefer", "memory")
    _, quality = advise(*SMALL, "--prefer", "quality")
    times = [o.estimate.step_s for o in speed]
    assert times == sorted(times) and speed[0].estimate.step_s <= ladder[0].estimate.step_s
    assert speed[0] is not ladder[0]
    peaks = [peak_fraction(o.base) for o in memory]
    assert peaks == sorted(peaks) and memory[0].rung.mode == "qlora"  # 4-bit base weights
    assert quality[0].rung.mode == "lora" and quality[0].rung.targets_label == "all-linear"


def test_full_mode_only_says_what_is_missing(capsys):
    argv = ["advise", "Llama-3.1-70B", "--mode", "full", "--gpus", "2xA100-80GB", "--seq", "2048"]
    assert cli.main(argv + ["--global-batch", "8"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the text wraps at 100 columns
    assert "needs >= 8 x A100-80GB (full fine-tuning" in out
    assert "or LoRA on 2 x A100-80GB (LoRA" in out


# ---- step-time estimate ----------------------------------------------------------------------


def tiny_resolved(tiny_llama, **settings):
    spec = from_hf_config(tiny_llama, name="tiny")
    cfg = C.load(None, [], {"hardware.gpus": "H100-80GB", "batch.seq_len": 128, **settings})
    return resolve(cfg, spec)


def test_flops_per_token_full_lora_and_recomputation(tiny_llama):
    # tiny Llama: hidden 64, MLP 160, 2 layers, q_dim 64, kv_dim 32, vocab 256, untied head
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160  # q, k, v, o, gate/up/down
    n = 2 * layer + 256 * 64  # + lm_head; the input embedding is a lookup, not a matmul
    attn = 4 * 2 * 64 * 128  # QK^T and AV, per token, forward
    assert estimate.flops_per_token(tiny_resolved(tiny_llama)) == 6 * n + 3 * attn
    ac = tiny_resolved(tiny_llama, **{"memory.activation_checkpointing": True})
    assert estimate.flops_per_token(ac) == 6 * n + 3 * attn + 2 * n + attn
    lora = tiny_resolved(tiny_llama, mode="lora", **{"lora.r": 8, "lora.target_modules": ["q_proj", "v_proj"]})
    adapter = 2 * (8 * (64 + 64) + 8 * (64 + 32))
    assert estimate.flops_per_token(lora) == 4 * n + 6 * adapter + 3 * attn
    assert estimate.flops_per_token(tiny_resolved(tiny_llama, mode="inference")) == 2 * n + attn


def test_single_device_step_is_flops_over_peak_times_mfu(tiny_llama):
    r = tiny_resolved(tiny_llama, **{"batch.micro_batch_size": 4, "batch.grad_accum_steps": 2})
    est = estimate.estimate(r)
    tokens = 4 * 2 * 128
    assert est.tokens_per_step == tokens
    assert est.step_s == pytest.approx(tokens * est.flops_per_token / (989e12 * 0.4))
    assert est.data_parallel_comm_s == est.tensor_parallel_comm_s == est.pipeline_s == 0
    calibrated = estimate.estimate(r, {"H100-80GB": 0.2})
    assert calibrated.step_s == pytest.approx(2 * est.step_s) and calibrated.mfu_source == {"H100-80GB": "calibrated"}


def test_communication_volume_per_strategy():
    def resolved(**settings):
        cfg = C.load(
            None,
            [],
            {"model.source": "Llama-3.1-8B", "hardware.gpus": "8xH100-80GB", "batch.seq_len": 1024, **settings},
        )
        return resolve(cfg)

    n, f, link = 8_030_261_248, 7 / 8, 450e9
    ddp = resolved(**{"batch.global_batch_size": 16})  # micro 1 x accum 2 x dp 8
    assert estimate.data_parallel_bytes(ddp) == pytest.approx(2 * f * n * 4)  # one all-reduce of fp32 grads
    zero2 = resolved(**{"batch.global_batch_size": 16, "parallel.strategy": "zero2"})
    assert estimate.data_parallel_bytes(zero2) == pytest.approx(2 * f * n * 4 + f * n * 4)
    zero3 = resolved(**{"batch.global_batch_size": 16, "parallel.strategy": "zero3"})
    assert estimate.data_parallel_bytes(zero3) == pytest.approx(2 * (2 * f * n * 2 + f * n * 4))
    assert estimate.estimate(zero3).data_parallel_comm_s == pytest.approx(estimate.data_parallel_bytes(zero3) / link)
    tp = resolved(**{"batch.global_batch_size": 4, "parallel.tp": 2})  # dp 4, micro 1, accum 1
    per_layer = 4 * 2 * (1 / 2) * 1024 * 4096 * 2  # 4 all-reduces of (tokens x hidden) bf16
    assert estimate.tensor_parallel_bytes(tp) == pytest.approx(32 * per_layer)
    pp = resolved(**{"batch.global_batch_size": 8, "parallel.pp": 2})  # dp 4, accum 2: bubble (2-1)/2
    est = estimate.estimate(pp)
    assert est.pipeline_s >= est.compute_s * 0.5


# ---- calibration from the run registry ---------------------------------------------------------


def test_calibration_from_records():
    cal = estimate.calibration_from_records(
        [
            {"device": "H100-80GB", "tokens_per_s": 500.0, "estimated_tokens_per_s": 1000.0},
            {"device": "H100-80GB", "tokens_per_s": 700.0, "estimated_tokens_per_s": 1000.0},
            {"device": "A100-80GB", "tokens_per_s": 1e4, "flops_per_token": 6e9, "peak_tflops": 312.0, "world_size": 2},
            {"device": "L4", "tokens_per_s": 0},
        ]
    )
    assert cal == {"H100-80GB": pytest.approx(0.4 * 0.6), "A100-80GB": pytest.approx(1e4 * 6e9 / (2 * 312e12))}


def test_compiled_runs_calibrate_compiled_jobs_and_eager_runs_eager_ones():
    """A compiled step runs at another MFU than the eager one: the registry's compiled runs calibrate
    a train.compile job, its eager runs an eager job (and a compiled job that has no compiled runs)."""
    cal = estimate.calibration_from_records(
        [
            {"device": "H100-80GB", "tokens_per_s": 500.0, "estimated_tokens_per_s": 1000.0},
            {"device": "H100-80GB", "tokens_per_s": 900.0, "estimated_tokens_per_s": 1000.0, "compiled": True},
        ]
    )
    assert cal == {"H100-80GB": pytest.approx(0.2), "H100-80GB, compiled": pytest.approx(0.36)}
    sets = {"model.source": "Llama-3.1-8B", "mode": "lora", "hardware.gpus": "H100-80GB", "batch.seq_len": 2048}
    eager = estimate.estimate(resolve(C.load(None, [], sets)), cal)
    compiled = estimate.estimate(resolve(C.load(None, [], {**sets, "train.compile": True})), cal)
    assert (eager.mfu, eager.mfu_source) == ({"H100-80GB": pytest.approx(0.2)}, {"H100-80GB": "calibrated"})
    assert compiled.mfu == {"H100-80GB": pytest.approx(0.36)}
    assert compiled.mfu_source == {"H100-80GB": "calibrated on compiled runs"}
    assert compiled.tokens_per_s == pytest.approx(eager.tokens_per_s * 0.36 / 0.2)
    fallback = estimate.estimate(resolve(C.load(None, [], {**sets, "train.compile": True})), {"H100-80GB": 0.2})
    assert fallback.mfu_source == {"H100-80GB": "calibrated on eager runs"} and fallback.mfu["H100-80GB"] == 0.2


def make_registry(path, rows):
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE runs (device TEXT, tokens_per_s REAL, config_toml TEXT)")
        db.executemany("INSERT INTO runs VALUES (?, ?, ?)", rows)
    return path


def test_registry_calibrates_the_estimate(tmp_path, capsys):
    measured_cfg = C.load(
        None,
        [],
        {
            "model.source": "Llama-3.1-8B",
            "mode": "lora",
            "hardware.gpus": "1x80GiB",  # what `trainplan train` records: the detected capacity
            "batch.seq_len": 2048,
            "batch.global_batch_size": 8,
        },
    )
    as_cataloged = replace(measured_cfg, hardware=replace(measured_cfg.hardware, gpus="H100-80GB"))
    predicted = estimate.estimate(resolve(as_cataloged)).tokens_per_s
    rows = [
        ("NVIDIA H100 80GB HBM3", predicted / 2, C.to_toml(measured_cfg)),  # the name CUDA reports
        ("NVIDIA H100 80GB HBM3", None, C.to_toml(measured_cfg)),  # a run that recorded no rate
        ("A800-weird", 1.0, C.to_toml(measured_cfg)),  # a device the catalog does not know
    ]
    db = make_registry(tmp_path / "runs.db", rows)
    argv = ["advise", "Llama-3.1-8B", "--gpus", "H100-80GB", "--seq", "2048", "--global-batch", "8"]
    assert cli.main(argv + ["--format", "json", "--registry", str(db)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "MFU 20.0% on H100-80GB, calibrated" in doc["estimate_note"]
    assert all(e["estimate"]["mfu"]["H100-80GB"] == pytest.approx(0.2) for e in doc["entries"])
    # the same configuration as the measured run is now estimated at the measured speed
    est = estimate.estimate(resolve(as_cataloged), {"H100-80GB": doc["entries"][0]["estimate"]["mfu"]["H100-80GB"]})
    assert est.tokens_per_s == pytest.approx(predicted / 2)


def test_registry_missing_or_without_table_falls_back_to_the_assumed_mfu(tmp_path, capsys):
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    for registry in (tmp_path / "absent.db", empty):
        argv = ["advise", "Llama-3.1-8B", "--gpus", "H100-80GB", "--format", "json", "--registry", str(registry)]
        assert cli.main(argv) == 0
        note = json.loads(capsys.readouterr().out)["estimate_note"]
        assert "MFU 40.0% on H100-80GB, assumed; no usable runs for these devices" in note


# ---- input and output ------------------------------------------------------------------------

BAD = [
    (["Llama-3.1-8C"], "model.source: unknown preset 'Llama-3.1-8C'; did you mean"),
    # (on 2 CPUs tp 2 now divides any batch: 3 CPUs and 32 heads leave data parallelism alone)
    (
        ["Llama-3.1-8B", "--gpus", "3xcpu", "--global-batch", "2"],
        "--global-batch: 2 is not divisible by the data-parallel",
    ),
    (["GPT-2", "--global-batch", "0"], "--global-batch: must be an integer >= 1 (got 0)"),
    (["GPT-2", "--prefer", "sped"], "--prefer: unknown value 'sped'; did you mean 'speed'"),
    (["GPT-2", "--mode", "lorra"], "--mode: unknown value 'lorra'; did you mean 'lora'"),
    (["GPT-2", "--margin", "1.5"], "--margin: must be in [0, 0.9) (got 1.5)"),
    (["GPT-2", "--gpus", "H1000"], "hardware.gpus: unknown device 'H1000'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_input_is_one_line_naming_the_field_and_fix(argv, message, tmp_path, capsys):
    out = tmp_path / "chosen.toml"
    assert cli.main(["advise", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_table_states_the_estimate_and_reasons(capsys):
    assert cli.main(["advise", *NODE_8B, "--top", "12"]) == 0  # the tp layouts train runs rank among the first
    out = " ".join(capsys.readouterr().out.split())  # the text wraps at 100 columns
    assert "candidate configurations planned in" in out
    assert "step time is an estimate (MFU 40.0% on H100-80GB, assumed" in out
    needed = r"(ZeRO-[123]|ZeRO-3/FSDP)( \(FSDP2 grad-op\))? needed: (DDP|ZeRO-[12]) exceeds GPU \d by"
    assert re.search(needed, out), out
    assert "... and" in out


def test_json_entries(capsys):
    assert cli.main(["advise", *SMALL, "--format", "json", "--top", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "trainplan.advise/1" and doc["fit"] == len(doc["entries"]) > 0
    assert doc["evaluated"] >= doc["rungs"]
    for e in doc["entries"]:
        assert e["peak"]["total_bytes"] <= e["peak"]["usable_bytes"]
        assert e["estimate"]["step_seconds"] > 0 and e["why"]


@pytest.mark.multiprocess
def test_advise_imports_no_torch():
    code = (
        "import sys; from trainplan.cli import main; "
        "rc = main(['advise', 'Llama-3.1-8B', '--gpus', 'RTX4090', '--format', 'json']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_out_file_plans_to_the_same_ledger(tmp_path, capsys):
    out = tmp_path / "chosen.toml"
    assert cli.main(["advise", *NODE_8B, "--format", "json", "--out", str(out)]) == 0
    entry = json.loads(capsys.readouterr().out)["entries"][0]
    assert out.read_text().startswith("# trainplan advise: meta-llama/Llama-3.1-8B on 8 x H100-80GB: row 1 of ")
    planned = tmp_path / "plan.json"
    assert cli.main(["plan", str(out), "--json", "--output", str(planned)]) == 0
    ledger = json.loads(planned.read_text())
    assert ledger["verdict"]["fits"] is True
    assert max(d["total_bytes"] for d in ledger["devices"]) == entry["peak"]["total_bytes"]
    assert ledger["settings"]["strategy"] == entry["strategy"]
    assert ledger["settings"]["micro_batch_size"] == entry["micro_batch_size"]


def test_rows_train_runs_come_first_and_out_writes_row_1(tmp_path, capsys):
    out = tmp_path / "chosen.toml"
    assert cli.main(["advise", *NODE_70B, "--format", "json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    refuses = [e["train_refuses"] for e in doc["entries"]]
    assert refuses[0] is None and refuses == sorted(refuses, key=bool)  # runnable rows first, then plan-only
    assert doc["out"]["row"] == 1 and doc["notes"] == []
    assert out.read_text().splitlines()[0].endswith(f"row 1 of {doc['fit']} (prefer ladder)")
    # the old order, by preference alone, ranks a plan-only row (bitsandbytes under FSDP) first
    assert cli.main(["advise", *NODE_70B, "--format", "json", "--include-unrunnable"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"][0]["train_refuses"] == "sharded 8-bit AdamW"
    cfg = C.load(out)
    assert cfg.optim.name == "adamw" and cfg.mode != "qlora" and (cfg.parallel.tp, cfg.parallel.pp) == (1, 1)
    assert cfg.parallel.strategy in ("ddp", "zero1", "zero3")
    assert plan(cfg).fits


def test_out_file_for_70b_on_8_a100_passes_trains_own_checks(tmp_path, capsys):
    """The written file is a real training config: train's capability check (resolve.require_runnable)
    accepts it, the step count comes from --tokens, the data is the user's, and the header says the
    preset needs its weights."""
    import math

    from trainplan.resolve import require_runnable, resolve

    out = tmp_path / "chosen.toml"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n")
    argv = ["advise", "Llama-3.1-70B", "--gpus", "8xA100-80GB", "--seq", "2048", "--global-batch", "64"]
    assert cli.main([*argv, "--tokens", "100000000", "--data", str(corpus), "--out", str(out)]) == 0
    capsys.readouterr()
    cfg = C.load(out)
    r = resolve(cfg)
    require_runnable(cfg, r.dims, max_positions=r.spec.max_position_embeddings, cuda=True)  # raises if not
    assert cfg.train.steps == math.ceil(100_000_000 / (64 * 2048))
    assert cfg.data.source == str(corpus.resolve())
    assert "names an architecture, not weights" in out.read_text().split("\nmode")[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "0"], r"^--tokens: must be >= 1 \(got 0\)"),
        (["--epochs", "-1"], r"^--epochs: must be a number > 0"),
        (["--epochs", "1"], r"^--epochs: counting the data's tokens needs the model's own tokenizer; give --tokens"),
        (["--data", "/nonexistent/corpus"], r"^--data: '/nonexistent/corpus' does not exist"),
        (["--tokens", "9", "--set", "train.steps=5"], r"^--tokens: train.steps is set too"),
    ],
)
def test_training_length_and_data_flags_refuse_bad_input(flags, message):
    from trainplan.commands import advise as advise_cmd
    from trainplan.errors import ConfigError

    args = cli.build_parser().parse_args(["advise", "Llama-3.1-8B", "--gpus", "8xA100-80GB", *flags])
    with pytest.raises(ConfigError, match=message):
        advise_cmd.request_from_args(args)


@pytest.mark.slow
def test_out_file_trains_as_it_is(tiny_run, tmp_path, capsys, monkeypatch):
    root, _ = tiny_run  # config.json (a tiny Llama) and a small corpus
    corpus = root / "corpus"
    monkeypatch.chdir(root)
    out = tmp_path / "chosen.toml"
    settings = [
        f"data.source={corpus}",
        "model.init=random",
        "data.eval_fraction=0.34",
        "train.steps=2",
        "train.eval_batches=2",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    argv = ["advise", "config.json", "--gpus", "cpu", "--seq", "32", "--global-batch", "8", "--out", str(out)]
    assert cli.main(argv + [x for s in settings for x in ("--set", s)]) == 0
    monkeypatch.chdir(tmp_path.parent)  # the written file names the model by its absolute path
    assert cli.main(["train", str(out)]) == 0
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert len(record["steps"]) == 2 and record["contract"]["passed"]
    # --epochs counts the training split as train packs it: 2 passes of 8 sequences per step
    monkeypatch.chdir(root)
    again = tmp_path / "epochs.toml"
    argv = ["advise", str(root / "weights"), "--gpus", "cpu", "--seq", "32", "--global-batch", "8", "--epochs", "2"]
    kept = [x for s in settings if not s.startswith(("model.init", "train.steps")) for x in ("--set", s)]
    assert cli.main(argv + ["--out", str(again), *kept]) == 0
    assert C.load(again).train.steps == -(-2 * record["data"]["train_sequences"] // 8)


def test_qlora_on_cuda_is_runnable_and_on_the_cpu_is_not():
    """advise asks train's own rule (resolve.require_runnable): QLoRA runs on CUDA GPUs."""
    s, order = advise("Llama-3.1-8B", "--gpus", "RTX4090", "--mode", "qlora", "--top", "0")
    qlora = [o for o in order if o.rung.mode == "qlora"]
    assert qlora and all(rank.train_blocker(s, o) in ("", "sharded 8-bit AdamW") for o in qlora)
    assert any(rank.train_blocker(s, o) == "" for o in qlora)


def test_a_run_length_gives_each_row_its_time_and_with_a_price_its_cost(tmp_path, capsys):
    """--tokens sets the steps; each row's run time is steps x its estimated step time, its device hours
    that x the devices, its cost those x --price; a registry run that measured half the assumed speed
    doubles the run time of the same configuration."""
    argv = ["advise", "Llama-3.1-8B", "--gpus", "2xH100-80GB", "--seq", "2048", "--tokens", "40960000"]
    assert cli.main([*argv, "--price", "2.5", "--format", "json", "--registry", "off", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    steps = math.ceil(40960000 / (2 * 2048))
    for e in doc["entries"]:
        run = e["run"]
        assert run["steps"] == steps and run["seconds"] == pytest.approx(steps * e["estimate"]["step_seconds"])
        assert run["device_hours"] == pytest.approx(run["seconds"] / 3600 * 2)
        assert run["cost"] == pytest.approx(run["device_hours"] * 2.5)
    assert cli.main([*argv, "--price", "2.5", "--registry", "off", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "run" in text and "cost" in text and "dev-h" in text
    assert cli.main([*argv, "--format", "json", "--registry", "off", "--top", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"][0]["run"]["cost"] is None  # no price, no cost
    first = doc["entries"][0]
    cfg = C.load(None, [], {"model.source": "Llama-3.1-8B", "hardware.gpus": "2xH100-80GB", "batch.seq_len": 2048})
    cfg = replace(cfg, mode=first["mode"])
    mfu = first["estimate"]["mfu"]["H100-80GB"]
    slower = estimate.estimate(resolve(cfg), {"H100-80GB": mfu / 2})
    faster = estimate.estimate(resolve(cfg), {"H100-80GB": mfu})
    assert steps * slower.step_s > 1.9 * steps * faster.step_s  # the calibrated estimate moves the run time


def test_advise_on_unpacked_data_plans_its_longest_row(tmp_path, capsys):
    """One document a row: the widest micro-batch of an epoch holds the longest row, so advise --data
    --epochs searches at that width, and the TOML it writes cuts rows where the request did."""
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": "a", "completion": "b c"}, {"prompt": "x", "completion": "y"}] * 3
    rows += [{"prompt": f"long {i}", "completion": "w " * 120} for i in range(4)]  # a hash splits: some train
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "chosen.toml"
    argv = ["advise", "default", "--gpus", "1xL4", "--seq", "256", "--data", str(data), "--epochs", "1"]
    argv += ["--set", "data.packing=none", "--set", "data.eval_fraction=0.2", "--registry", "off"]
    assert cli.main([*argv, "--format", "json", "--top", "1", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    widest = doc["request"]["seq_len"]
    assert 120 < widest < 256 and any(f"longest row, {widest} tokens" in n for n in doc["notes"])
    written = C.load(str(out))
    assert written.batch.seq_len == widest and written.data.max_length == 256
