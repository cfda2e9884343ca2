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
