"""A two-node run on one machine: the torchrun script `trainplan launch` writes, started twice as two
"nodes" of one CPU rank each (gloo, c10d rendezvous on the loopback), trains a tiny model with FSDP2
(zero3) into one shared output directory, with the same losses as a 2-rank --standalone run. When
one node is killed mid-run the other ends within a bounded time, naming the lost peer, and a relaunch
of both continues from the last checkpoint to the same weights, bitwise."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_fault_injection import _kill_tree

from trainplan import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def settings(tiny_run):
    root, base = tiny_run
    sets = [*base, f"model.source={root / 'weights'}", "model.init=auto", "batch.micro_batch_size=2"]
    return sets + ["parallel.strategy=zero3", "train.steps=4", "checkpoint.every=2", "train.measure_memory=false"]


def node_env(home: Path) -> dict:
    # the run registry and caches of these processes stay in the test's own home; one thread per rank,
    # as torchrun sets for several ranks per node but not for one (else the sums' order, so the bits, differ)
    env = {**os.environ, "HOME": str(home), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the environment's torchrun
    return env


def launch_script(where: Path, sets: list[str]) -> Path:
    """`trainplan launch --target torchrun` for two nodes of one CPU rank, on a fresh port."""
    script = where / f"launch-{len(list(where.glob('launch-*')))}.sh"
    flags = ["--gpus", "2xcpu"] + [x for item in sets for x in ("--set", item)]
    port = str(free_port())
    code = cli.main(["launch", *flags, "--target", "torchrun", "--nodes", "2", "--port", port, "-o", str(script)])
    assert code == 0
    return script


def start_nodes(script: Path, home: Path) -> list[subprocess.Popen]:
    env = node_env(home)
    return [
        subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]


def finish(nodes: list[subprocess.Popen]) -> None:
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-2000:] + err[-4000:]


@pytest.fixture(scope="module")
def two_nodes(settings, tmp_path_factory):
    """The uninterrupted two-node run: its record."""
    where = tmp_path_factory.mktemp("two_nodes")
    shared = where / "shared"
    script = launch_script(where, [*settings, f"train.output_dir={shared}"])
    text = script.read_text()
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d" in text and "checkpoint.resume=auto" in text
    finish(start_nodes(script, where))
    record = json.loads((shared / "record.json").read_text())
    assert record["hardware"]["world_size"] == 2 and record["resume"]["from"] is None  # nothing to resume yet
    assert sorted(p.name for p in (shared / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-00000002",
        "step-00000004",
    ]
    return record


def test_two_nodes_on_loopback_match_a_standalone_run(settings, two_nodes, tmp_path):
    reference = tmp_path / "standalone"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainplan"]
    cmd += ["train", "--registry", "off"]
    cmd += [x for item in [*settings, f"train.output_dir={reference}"] for x in ("--set", item)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=node_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    standalone = json.loads((reference / "record.json").read_text())
    assert [s["loss"] for s in two_nodes["steps"]] == [s["loss"] for s in standalone["steps"]]
    assert two_nodes["final"]["weights_hash"] == standalone["final"]["weights_hash"]


def test_a_lost_node_ends_the_other_and_a_relaunch_continues_bitwise(settings, two_nodes, tmp_path):
    """The node holding rank 1 stops it at step 3 (after checkpoint 2: an injected hang), then that whole
    node is killed (torchrun and rank, SIGKILL). The other node must end non-zero within 60 s, its log
    naming the lost peer; the same launch of both nodes again resumes from step 2 and ends on the
    uninterrupted run's weights. (The rendezvous, not the order of start, decides which node has rank 1.)"""
    shared = tmp_path / "shared"
    # a lost machine that closes no connection is caught by this timeout; a killed one at once
    sets = [*settings, f"train.output_dir={shared}", "parallel.timeout_s=30"]
    nodes = start_nodes(launch_script(tmp_path, [*sets, 'guard.inject=["hang@3"]']), tmp_path)
    deadline = time.monotonic() + 120
    while not any(_stopped(n.pid) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    lost = next((n for n in nodes if _stopped(n.pid)), None)
    if lost is None:
        for n in nodes:
            _kill_tree(n.pid)
        pytest.fail(f"rank 1 never reached step 3:\n{nodes[0].communicate()[1][-3000:]}")
    (survivor,) = [n for n in nodes if n is not lost]
    _kill_tree(lost.pid)
    t0 = time.monotonic()
    try:
        _, err = survivor.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _kill_tree(survivor.pid)
        pytest.fail(f"the surviving node still ran 60 s after the other was lost:\n{survivor.communicate()[1][-3000:]}")
    elapsed = time.monotonic() - t0
    lost.communicate()
    assert survivor.returncode != 0
    assert elapsed < 60, elapsed
    # trainplan's own line (torchrun's agent names only its own failed rank)
    assert f"error: rank 0 on node {socket.gethostname()} lost rank 1 (the peer at 127.0.0.1:" in err, err[-3000:]

    finish(start_nodes(launch_script(tmp_path, sets), tmp_path))
    resumed = json.loads((shared / "record.json").read_text())
    assert resumed["resume"]["step"] == 2
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in two_nodes["steps"][2:]]
    assert resumed["final"]["weights_hash"] == two_nodes["final"]["weights_hash"]


def _stopped(pid: int) -> bool:
    """Whether a process below `pid` is stopped (SIGSTOP: the injected hang)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "T" and _descends(int(entry), pid):
            return True
    return False


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False
