"""Per-node preflight (run/preflight.py): each check with faked sizes, the plan's bill, the hook in a
real run, and two gloo ranks that do not see one checkpoint directory."""

import os
import shlex
import subprocess
import sys
import time

import pytest
import torch

from trainplan import config as C
from trainplan.plan.analytic import plan
from trainplan.plan.bill import preflight_bill
from trainplan.run import preflight
from trainplan.run.dist import DistEnv
from trainplan.spec.devices import GiB, MiB

ONE_CPU = DistEnv(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
ONE_GPU = DistEnv(rank=0, world=1, local_rank=0, device=torch.device("cuda", 0))


@pytest.fixture
def node(monkeypatch):
    """A node named n7 with 10 GiB free on its GPU and 20 GiB of available host RAM (settable)."""
    sizes = {"gpu": 10 * GiB, "ram": 20 * GiB}
    monkeypatch.setattr(preflight, "hostname", lambda: "n7")
    monkeypatch.setattr(preflight, "free_device_bytes", lambda device: sizes["gpu"])
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: sizes["ram"])
    return sizes


def bill(device: float, host: float, margin: float = 0) -> preflight.Bill:
    return preflight.Bill(
        device_bytes=(int(device * GiB),), device_margin_bytes=(int(margin * GiB),), host_bytes=(int(host * GiB),)
    )


def test_free_device_memory_must_cover_the_rank_s_bill(node):
    assert "device memory, host RAM" in preflight.check(ONE_GPU, None, bill(10, 1))
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(ONE_GPU, None, bill(12.5, 1))
    (line,) = str(e.value).splitlines()
    assert line.startswith("preflight: node n7 rank 0: cuda:0 has 10.00 GiB free, the plan needs 12.50 GiB")
    assert "short by 2.50 GiB" in line


def test_free_memory_short_of_the_margin_only_warns_as_the_plan_s_tight(node):
    """The plan's TIGHT (the need fits, its margin does not) runs with a warning; DOES NOT FIT stops."""
    assert "TIGHT" not in preflight.check(ONE_GPU, None, bill(8, 1, margin=2))  # 10 GiB free covers both
    said = preflight.check(ONE_GPU, None, bill(9, 1, margin=2))
    assert said.endswith(
        "; TIGHT on rank 0: cuda:0 has 10.00 GiB free for a need of 9.00 GiB and a 2.00 GiB margin, "
        "so it may run out of memory"
    )
    with pytest.raises(preflight.PreflightError, match="short by 0.50 GiB"):
        preflight.check(ONE_GPU, None, bill(10.5, 1, margin=2))


def test_host_ram_must_cover_the_node_s_ranks(node):
    node["ram"] = 3 * GiB
    assert preflight.check(ONE_CPU, None, bill(0, 3)) == "host RAM on 1 node(s), 1 rank(s)"  # no GPU to check
    with pytest.raises(preflight.PreflightError, match=r"node n7 rank 0: host RAM has 3.00 GiB available, .* needs "):
        preflight.check(ONE_CPU, None, bill(0, 3.25))
    problem = preflight.host_problem("n7", [8, 9, 10], 3 * GiB, 4 * GiB, "the analytic plan")
    assert "for the node's 3 ranks (8, 9, 10) to load and save checkpoints: short by 1.00 GiB" in problem
    assert preflight.host_problem("n7", [0], None, 4 * GiB, "x") is None  # no /proc/meminfo: nothing to say


def test_without_a_bill_no_memory_is_checked(node):
    node["gpu"] = node["ram"] = 0
    assert preflight.check(ONE_GPU, None, None).startswith("nothing to check: no plan given")


def test_the_probe_file_is_written_read_and_removed(tmp_path):
    where = tmp_path / "new" / "checkpoints"
    token, created = preflight.write_probe(where)
    assert preflight.read_probe(where) == token and len(token) == 32
    assert preflight.probe_problem("n1", 1, where, token, token, "n0") is None
    missing = preflight.probe_problem("n1", 1, where, token, None, "n0")
    assert missing.startswith(f"preflight: node n1 rank 1: checkpoint directory '{where}' is not the one rank 0 (n")
    assert "its probe file is missing" in missing
    assert "holds another run's token" in preflight.probe_problem("n1", 1, where, token, "0" * 32, "n0")
    preflight.remove_probe(where, created)
    assert not (tmp_path / "new").exists()  # what the probe created goes with it
    assert preflight.read_probe(where) is None


def test_the_bill_is_the_plan_s(make_cfg):
    """Device: the plan's need (its margin apart), less the CUDA context already resident; host: a DDP
    resume reads the weights and optimizer state whole, FSDP's (DCP) reads in place, and the main
    rank of a full fine-tune gathers the whole model to save the result."""
    tiny = {"model__source": "tiny-llama", "precision": "fp32"}
    ddp = make_cfg(**tiny, hardware__gpus="2xH100-80GB")
    d = plan(ddp).devices[1]
    got = preflight_bill(ddp)
    assert got.device_bytes[1] == d.peak_allocated + d.runtime_bytes - 600 * MiB
    assert got.device_margin_bytes[1] == d.error_margin_bytes + d.reserve_bytes > 0
    params = plan(ddp).model["params"]
    assert got.host_bytes == (params * 4 * 3,) * 2  # fp32 weights + AdamW's two states
    fsdp = make_cfg(**tiny, hardware__gpus="2xH100-80GB", parallel__strategy="zero3")
    assert preflight_bill(fsdp).host_bytes == (params * 4, 0)
    cpu = preflight_bill(make_cfg(**tiny, hardware__gpus="2xcpu"))
    assert cpu.host_bytes == cpu.device_bytes  # a CPU rank's device is host memory


def test_a_declared_host_memory_too_small_for_the_offloaded_checkpoints_is_refused_by_name(make_cfg):
    """Checkpoints in host memory on a GPU: the plan's host column holds them, and a hardware.host_mem
    that cannot is the user's figure to fix (exit 2, one line), where the plan itself says DOES NOT FIT."""
    from trainplan.errors import ConfigError

    sets = {"model__source": "tiny-llama", "hardware__gpus": "1xH100-80GB", "batch__seq_len": 4096}
    sets |= {"memory__activation_checkpointing": True, "memory__offload_activations": True}
    enough = make_cfg(**sets, hardware__host_mem="64GiB")
    host = plan(enough).host
    assert host.components["activations"] > 1 * MiB and host.state == "FITS"
    assert preflight_bill(enough).host_bytes[0] >= host.components["activations"]
    short = make_cfg(**sets, hardware__host_mem="1MiB")
    assert plan(short).host.state == "DOES NOT FIT"
    with pytest.raises(
        ConfigError, match=r"^hardware\.host_mem: 1MiB cannot hold the .* offloads to a node's host"
    ) as e:
        preflight_bill(short)
    assert "\n" not in str(e.value) and "memory.offload_activations = false" in str(e.value)
    assert preflight_bill(make_cfg(**sets)).host_bytes[0] > 0  # undeclared: the preflight measures this machine


def test_a_run_is_stopped_before_its_model_is_built(tiny_run, tmp_path, monkeypatch):
    from trainplan.commands.train import execute
    from trainplan.run import weights

    root, base = tiny_run
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 1 * MiB)
    monkeypatch.setattr(weights, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    cfg = C.load(None, [*base, f"train.output_dir={tmp_path / 'out'}"])
    with pytest.raises(preflight.PreflightError, match=r"host RAM has 0.00 GiB available, the analytic plan needs"):
        execute(cfg, "off", quiet=True)
    assert not (tmp_path / "out" / ".trainplan.lock").exists()  # the run's lock was released


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_without_a_shared_directory_both_stop(tiny_run, tmp_path):
    """Each rank starts in a directory of its own and writes to the relative output directory `out`:
    two directories, as on two nodes without a shared filesystem. Both ranks end non-zero, each
    naming the rank that cannot see rank 0's probe."""
    root, base = tiny_run
    sets = [*base, "train.output_dir=out", "train.measure_memory=false"]
    train = [sys.executable, "-m", "trainplan", "train", "--registry", "off"]
    train += [x for item in sets for x in ("--set", item)]
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    # each rank records its own exit code; SIGTERM ignored: torchrun stops the other ranks once one has
    # failed, and each must be seen to end by itself
    rank_shell = f"trap '' TERM; cd node$LOCAL_RANK && {shlex.join(train)}; code=$?; echo $code > ../exit$LOCAL_RANK"
    rank_shell += "; exit $code"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"]
    cmd += ["bash", "-c", rank_shell]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    exits = [(tmp_path / f"exit{rank}").read_text().strip() for rank in (0, 1)]
    assert exits == ["2", "2"], (exits, proc.stderr[-3000:])
    line = "error: preflight: node {} rank 1: checkpoint directory 'out/checkpoints' is not the one rank 0"
    assert proc.stderr.count(line.format(preflight.hostname())) == 2, proc.stderr[-3000:]  # rank 0's and its own
    assert not (tmp_path / "node0" / "out" / "checkpoints").exists()  # the probe and its directory removed
    assert elapsed < 30, elapsed  # about 10 s here
