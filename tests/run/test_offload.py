"""parallel.offload_optimizer on one device: FSDP2's CPUOffloadPolicy over a one-rank mesh (its
process group in memory). On the CPU the host is the device, so the run is the plain run's, with
FSDP2 applied and the group left when the run ends."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from trainplan import config as C
from trainplan.commands.train import execute


def _run(tiny_run, out, *extra) -> dict:
    root, base = tiny_run
    sets = [*base, f"model.source={root / 'weights'}", "model.init=auto", f"train.output_dir={out}", *extra]
    return execute(C.load(None, sets), quiet=True)[0].to_json()


def test_offload_on_one_device_runs_fsdp2_alone_and_trains_as_the_plain_run(tiny_run, tmp_path):
    plain = _run(tiny_run, tmp_path / "plain")
    offloaded = _run(tiny_run, tmp_path / "offload", "parallel.strategy=zero3", "parallel.offload_optimizer=true")
    assert plain["hardware"]["fsdp_offload"] is None
    assert offloaded["hardware"]["fsdp_offload"] == "CPUOffloadPolicy"
    assert offloaded["hardware"]["world_size"] == 1 and not dist.is_initialized()  # the one-rank group is gone
    # what ran, read back from the engine's objects: FSDP2 on a one-rank group, and a plain module
    ran, plain_ran = offloaded["hardware"]["ran"], plain["hardware"]["ran"]
    assert (ran["strategy"], ran["world_size"], ran["fsdp_offload"]) == ("zero3", 1, "CPUOffloadPolicy")
    assert (plain_ran["strategy"], plain_ran["world_size"], plain_ran["fsdp_offload"]) == ("single", 1, None)
    assert ran["trainable_dtypes"] == plain_ran["trainable_dtypes"] == ["float32"] and ran["lora_modules"] == 0
    ours, ref = ([s["loss"] for s in r["steps"]] for r in (offloaded, plain))
    assert ours == pytest.approx(ref, rel=1e-5)
    assert offloaded["eval_after"]["loss"] == pytest.approx(plain["eval_after"]["loss"], rel=1e-5)
    from trainplan.plan import analytic
    from trainplan.verify import checks

    ledger = analytic.plan(C.from_dict(offloaded["config"]))
    assert ledger.settings["strategy"] == "zero3" and ledger.host is None  # on the CPU nothing moves
    step_peaks = [m["peak_bytes"] for m in offloaded["memory"]["per_rank"]]
    rows = checks.compare_phases(ledger, offloaded["phase_memory"]["per_rank"], step_peaks, 0.05)[0]
    assert rows and all(r["ok"] for r in rows), [(r["phase"], r["planned"], r["measured"]) for r in rows]


def test_offload_resumes_from_its_checkpoint(tiny_run, tmp_path):
    """A one-device offloaded run checkpoints through DCP and a second run resumes from it."""
    sets = ["parallel.strategy=zero3", "parallel.offload_optimizer=true", "checkpoint.every=1"]
    first = _run(tiny_run, tmp_path / "run", *sets, "train.steps=2")
    resumed = _run(tiny_run, tmp_path / "run", *sets, "train.steps=3", "checkpoint.resume=auto")
    assert first["steps"][-1]["step"] == 2 and resumed["resume"]["from"] is not None
    assert [s["step"] for s in resumed["steps"]] == [3]


def test_activation_offload_trains_as_the_plain_run_and_moves_what_the_plan_says(tiny_run, tmp_path):
    """memory.offload_activations on the CPU: the hooks run and count what they pass to the host (where it
    stays: the host is the device), one micro-batch's forward at a time, and stand aside in evaluation.
    The losses are the plain run's, bitwise, and the bytes the plan's."""
    from trainplan.plan import analytic
    from trainplan.verify import checks

    accumulate = ["batch.micro_batch_size=2", "batch.grad_accum_steps=2"]  # a forward and backward per micro-batch
    plain = _run(tiny_run, tmp_path / "plain", *accumulate)
    moved = _run(tiny_run, tmp_path / "offload", *accumulate, "memory.offload_activations=true")
    assert [s["loss"] for s in moved["steps"]] == [s["loss"] for s in plain["steps"]]
    assert moved["eval_after"]["loss"] == plain["eval_after"]["loss"]
    measured = moved["memory"]["per_rank"][0]["offloaded_activation_bytes"]
    assert "offloaded_activation_bytes" not in plain["memory"]["per_rank"][0]
    ledger = analytic.plan(C.from_dict(moved["config"]))
    planned = ledger.devices[0].offloaded_activation_bytes
    assert planned > 0 and abs(planned - measured) <= 0.05 * measured, (planned, measured)
    assert ledger.host is None  # nothing moves on the CPU
    from trainplan.run.record import RunRecord

    check = checks.check_memory(RunRecord(**moved), ledger, 0.05)
    row = [r for r in check.evidence["rows"] if r["component"].startswith("offloaded activations")]
    assert check.passed and len(row) == 1 and row[0]["measured"] == measured, check.summary


@pytest.mark.parametrize(
    "sets",
    [
        ["precision=fp32", "memory.activation_checkpointing=1"],  # layer 1 offloaded, layer 0 recomputed
        ["precision=amp-bf16", "mode=lora"],  # autocast's weight copies stay; layer 0's input needs no grad
        # checkpoints in host memory (issue 67): every layer's kept input copied out, and back for its recompute
        ["precision=fp32", "memory.activation_checkpointing=true"],
        ["precision=amp-bf16", "mode=lora", "memory.activation_checkpointing=true"],
    ],
)
def test_offload_hooks_copy_and_restore_bitwise(tiny_run, sets):
    """The copy path (the GPU's, here to fresh host buffers): gradients are bitwise the plain forward's,
    and the bytes copied are the plan's to the byte."""
    import torch

    from trainplan import resolve
    from trainplan.features.activation_offload import engine as offload
    from trainplan.plan import context
    from trainplan.plan import terms as T
    from trainplan.run import build, step

    root, _ = tiny_run

    def backward(*extra):
        cfg = C.load(
            None,
            [
                f"model.source={root / 'config.json'}",
                "model.init=random",
                "batch.seq_len=32",
                "batch.micro_batch_size=4",
            ]
            + sets
            + list(extra),
        )
        r = resolve.resolve(cfg)
        torch.manual_seed(0)
        model = build.materialize(build.build_model(r.spec, cfg, r.precision), "cpu")
        hooks = offload.of(model)
        if hooks is not None:
            hooks.copy_on_host = True
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
        with step.autocast(r.precision, "cpu"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [p.grad for p in model.parameters() if p.requires_grad], hooks, r

    plain, _, _ = backward()
    copied, hooks, r = backward("memory.offload_activations=true")
    assert all(torch.equal(a, b) for a, b in zip(plain, copied, strict=True))
    ctx = context.rank_context(r, 0)
    assert hooks.peak_bytes == T.activations(ctx).offloaded > 0
