"""A two-node run on one machine: the torchrun script `trainplan launch` writes, started twice as two
"nodes" of one CPU rank each (gloo, c10d rendezvous on the loopback), trains a tiny model with FSDP2
(zero3) into one shared output directory, with the same losses as a 2-rank --standalone run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match_a_standalone_run(tiny_run, tmp_path):
    root, base = tiny_run
    sets = [*base, f"model.source={root / 'weights'}", "model.init=auto", "batch.micro_batch_size=2"]
    sets += ["parallel.strategy=zero3", "train.steps=4", "checkpoint.every=2", "train.measure_memory=false"]
    shared = tmp_path / "shared"
    flags = ["--gpus", "2xcpu"] + [x for item in [*sets, f"train.output_dir={shared}"] for x in ("--set", item)]
    script = tmp_path / "launch.sh"
    port = free_port()
    code = cli.main(["launch", *flags, "--target", "torchrun", "--nodes", "2", "--port", str(port), "-o", str(script)])
    assert code == 0
    text = script.read_text()
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d" in text and "checkpoint.resume=auto" in text
    # the run registry and caches of these processes stay in the test's own home; one thread per rank,
    # as torchrun sets for several ranks per node but not for one (else the sums' order, so the bits, differ)
    env = {**os.environ, "HOME": str(tmp_path), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the environment's torchrun
    nodes = [
        subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-2000:] + err[-4000:]
    two_nodes = json.loads((shared / "record.json").read_text())
    assert two_nodes["hardware"]["world_size"] == 2 and two_nodes["resume"]["from"] is None  # nothing to resume yet
    assert sorted(p.name for p in (shared / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-00000002",
        "step-00000004",
    ]

    reference = tmp_path / "standalone"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainplan"]
    cmd += ["train", "--registry", "off"]
    cmd += [x for item in [*sets, f"train.output_dir={reference}"] for x in ("--set", item)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    standalone = json.loads((reference / "record.json").read_text())
    assert [s["loss"] for s in two_nodes["steps"]] == [s["loss"] for s in standalone["steps"]]
    assert two_nodes["final"]["weights_hash"] == standalone["final"]["weights_hash"]
