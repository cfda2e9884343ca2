"""`trainplan devices` on the CPU, and the prepared GPU validation script's CPU smoke run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainplan import cli
from trainplan.verify import preflight as D

ROOT = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU inventory of a machine without GPUs")


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "trainplan", *args], capture_output=True, text=True, **kw)


@cpu_only
@pytest.mark.multiprocess
def test_json_inventory_of_the_cpu_and_what_was_not_checked():
    r = run("devices", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "trainplan.devices/1" and doc["passed"] is True and doc["failed"] == []
    (cpu,) = doc["inventory"]["devices"]
    assert cpu["kind"] == "cpu" and cpu["label"] == "cpu" and cpu["cores"] >= 1
    assert 0 < cpu["free_bytes"] <= cpu["capacity_bytes"]
    assert cpu["capacity_bytes"] == int(Path("/proc/meminfo").read_text().split()[1]) * 1024  # MemTotal
    assert doc["inventory"]["versions"]["cuda"] == "none" and doc["inventory"]["versions"]["torch"] == torch.__version__
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["determinism"]["passed"] is True
    assert checks["matmul cpu"]["passed"] is None and checks["matmul cpu"]["evidence"]["tflops"] > 0
    assert "no nominal figure" in checks["matmul cpu"]["summary"]
    not_checked = "\n".join(doc["not_checked"])
    for gpu_check in ("GPU inventory", "bf16 matmul", "P2P", "NCCL all-reduce", "cross-device loss identity"):
        assert gpu_check in not_checked


@cpu_only
@pytest.mark.multiprocess
def test_table_to_file_lists_what_was_not_checked(tmp_path):
    out = tmp_path / "devices.txt"
    r = run("devices", "--skip-health", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    text = out.read_text()
    assert text.splitlines()[0].split()[:4] == ["device", "name", "capacity", "free"]
    assert text.splitlines()[1].startswith("cpu ")
    assert "CUDA none" in text and "Not checked:" in text and "--skip-health" in text
    assert "Health checks:" not in text and text.rstrip().endswith("PASS: every check that ran passed")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "0"], "--gpus: GPU 0 is not present; this machine has 0 CUDA GPU(s)"),
        (["--gpus", "a,b"], "--gpus: 'a,b' is not a list of GPU indices; write e.g. 0,1"),
        (["--matmul-size", "3"], "--matmul-size: must be between 64 and 32768 (got 3)"),
        (["--min-matmul-ratio", "1.5"], "--min-matmul-ratio: must be in (0, 1] (got 1.5)"),
        (["--allreduce-mib", "0"], "--allreduce-mib: must be in (0, 16384] (got 0)"),
    ],
)
@cpu_only
@pytest.mark.multiprocess
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    out = tmp_path / "devices.json"
    r = run("devices", *args, "--json", "-o", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainplan devices: error: {message}"), r.stderr
    assert r.stdout == "" and not out.exists()


@pytest.mark.multiprocess
def test_a_failed_check_exits_1_and_is_named(monkeypatch, capsys):
    failed = D.CheckResult(name="matmul cuda:0", passed=False, summary="bfloat16 8192^3: 12% of nominal")
    monkeypatch.setattr(D, "health_checks", lambda inv, targets, args: ([failed], ["nothing else"]))
    assert cli.main(["devices", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and doc["failed"] == ["matmul cuda:0"]
    assert cli.main(["devices"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL: matmul cuda:0")


@pytest.mark.multiprocess
def test_determinism_check_compares_two_real_runs():
    cpu = D.cpu_info()
    same = D.check_determinism([cpu], seed=0)
    assert same.passed is True and same.evidence["repeat_identical"] == {"cpu": True}
    first, second = same.evidence["losses"]["cpu"]
    assert first == second
    before, after = (float.fromhex(x) for x in first)
    assert math.isfinite(before) and after < before  # one AdamW step on the batch lowers its loss
    different = D.check_determinism([cpu], seed=0, second_seed=1)
    assert different.passed is False and different.summary == "losses differ on cpu"
    assert different.evidence["losses"]["cpu"][0] == first and different.evidence["losses"]["cpu"][1] != first


@pytest.mark.parametrize(
    ("reported", "entry"),
    [
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),  # not an L4: no catalog entry, so no nominal figure
    ],
)
def test_reported_gpu_names_map_to_catalog_entries(reported, entry):
    found = D.catalog_entry(reported)
    assert (found.name if found else None) == entry


@pytest.mark.multiprocess
def test_allreduce_on_two_gloo_processes():
    result = D.check_allreduce(2, "gloo", 1, iters=3)
    assert result.passed is True, result.summary
    ev = result.evidence
    assert ev["correct_per_rank"] == [True, True] and ev["bytes"] == 2**20
    assert ev["busbw_gbps"] == pytest.approx(ev["algbw_gbps"])  # 2(n-1)/n = 1 for two ranks
    assert ev["busbw_gbps"] > 0


def test_gpu_matrix_covers_the_issue_and_fits_one_h200(bench_script):
    from trainplan import config as C
    from trainplan import resolve
    from trainplan.plan import analytic

    gv = bench_script("gpu_validate")
    assert len(gv.MATRIX) >= 16
    short = [row for row in gv.MATRIX if row not in gv.LONG_CONTEXT]
    _, modes, _, micro, seqs, ac, _ = (set(col) for col in zip(*map(gv.unpack, short), strict=True))
    assert (
        modes == {"inference", "full", "lora", "qlora"}
        and micro == {1, 4, 8}  # 8: a capacity-edge row (issue 34)
        and seqs == {512, 2048, 4096, 4864, 6912}
        and ac == {True, False, 14, "auto"}  # every layer, none, the first 14, the planner's choice
    )
    for row in gv.MATRIX:
        cfg = C.load(None, gv.row_settings(row, row[0], "H200-141GB"))
        assert 0.4e9 < resolve.resolve(cfg).spec.num_params < 8.5e9, row  # presets of 0.5B to 8B
        ledger = analytic.plan(cfg)
        edge = row[4] > 4096 and row not in gv.LONG_CONTEXT  # the capacity-edge rows (issue 34)
        if edge and not cfg.memory.expandable_segments:  # the default mode beside a capacity-edge row: the
            assert ledger.state != "FITS", row  # measurement is whether the run fits where the plan cannot say
        else:
            assert ledger.fits, (row, ledger.verdict())
    edges = [row for row in short if gv.OFF not in gv.unpack(row)[6] and row[4] > 4096]
    assert [row[4] for row in gv.LONG_CONTEXT] == [65536, 131072]  # issue 67's rows: 64K and more, planned to fit
    assert len(edges) == 2 and all(gv.unpack(row)[:6] + ((gv.OFF,),) in gv.MATRIX for row in edges)


@pytest.mark.multiprocess
def test_gpu_validate_smoke_run_writes_the_results(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run(
        # one trace worker process: the path the GPU run takes
        [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--smoke", "--trace-workers", "1", "--out", str(out)]
        + ["--snapshot", str(tmp_path / "snap")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "trainplan.gpu_validate/1" and doc["kind"] == "smoke"
    assert {"versions", "devices", "targets", "rows", "summary", "elapsed_s"} <= set(doc)
    assert doc["devices"]["passed"] is True and doc["targets"] == {"allocated": 0.03, "reserved": 0.05}
    assert [row["config"]["mode"] for row in doc["rows"]] == ["full", "lora", "full", "full", "full"]
    moved = doc["rows"][2]["measured"]  # activation offload: the hooks' bytes as planned
    assert moved["offloaded_activation_bytes"] > 0 and moved["offloaded_vs_plan"] == 0
    tp = doc["rows"][3]  # rank 0 of tp 2, its peer faked: the analytic plan's rank 0, traced the same way
    assert tp["status"] == "ok" and tp["targets_met"]["analytic_allocated"] is True
    assert 'hardware.gpus="2xcpu"' in tp["settings"]
    plans = tp["plan"]["analytic"]["phases"], tp["plan"]["traced"]["phases"]
    assert all(plans[1][ph] == pytest.approx(plans[0][ph], rel=1e-3) for ph in ("forward", "backward")), plans
    pp = doc["rows"][4]  # the first stage of pp 2, its peer faked, its metadata static: 1F1B and the step
    assert pp["status"] == "ok" and pp["targets_met"]["analytic_allocated"] is True, pp
    assert pp["targets_met"]["traced_allocated"] is True and 'hardware.gpus="2xcpu"' in pp["settings"]
    assert set(pp["measured"]["phases"]) == {"1f1b", "optimizer"}
    for row in doc["rows"][:3]:
        assert row["status"] == "ok", row
        assert {"plan", "measured", "errors", "targets_met", "throughput", "hf"} <= set(row)
        assert row["plan"]["analytic"]["peak_bytes"] > 0 and row["plan"]["traced"]["peak_bytes"] > 0
        m = row["measured"]
        assert m["source"] == "storage tracker (CPU)" and set(m["phases"]) == {"forward", "backward", "optimizer"}
        # on the CPU the fake-tensor trace allocates exactly what the real step does
        assert row["errors"]["traced_vs_allocated"] == 0.0 and row["targets_met"]["analytic_allocated"] is True
        assert row["targets_met"]["analytic_reserved"] is None  # no allocator reserve on the CPU
        assert len(row["throughput"]["losses"]) == 3 and row["throughput"]["tokens_per_s"] > 0
        assert row["snapshot"] == "not taken: the allocator's history is CUDA's"  # --snapshot on the CPU
    lora = doc["rows"][1]
    assert lora["hf"]["tokens_per_s"] > 0 and lora["hf"]["ratio_trainplan_over_hf"] > 0
    assert doc["rows"][0]["hf"] is None
    assert doc["summary"]["ok"] == 5 and doc["summary"]["analytic_allocated"] == "5/5"
    tail = r.stdout.strip().splitlines()
    assert tail[-7].startswith("row ") and "5/5 rows ran" in tail[-1]  # the table is printed last
