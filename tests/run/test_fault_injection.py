"""kill -9 at 50 points across one process, DDP and FSDP2 (2 gloo ranks each): half of them
injected inside a checkpoint's write, its publication (complete, not yet renamed) or the pruning of
an older one, the rest at a random moment (start-up, training, evaluation, writing). Each time,
`checkpoint.resume = auto` must carry on from the newest complete checkpoint with no manual
clean-up, and the chain must end with the same weights, bitwise, as an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

INJECTED = ("kill-writing", "kill-publishing", "kill-pruning")
MODES = {  # name: (processes, settings, kills)
    "single": (1, ["batch.micro_batch_size=4"], 20),
    "ddp": (2, ["parallel.strategy=ddp", "batch.micro_batch_size=2"], 15),
    "fsdp2": (2, ["parallel.strategy=zero3", "batch.micro_batch_size=2"], 15),
}
# The run's steps: the chain's worst case (an injected kill moves the newest checkpoint on by 1 or 2
# steps, a random one by 0 to 4: it waits for up to 3 new checkpoints, then 50 ms more), and 5 after it.
# Each step writes a checkpoint, so the steps the uninterrupted tail runs are the chain's cost.
STEPS = {mode: 3 * kills + 5 for mode, (_, _, kills) in MODES.items()}


def _cmd(tiny_run, nproc, out, steps, *extra):
    root, base = tiny_run
    launcher = [sys.executable, "-m", "trainplan"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        launcher += ["-m", "trainplan"]
    args = [*launcher, "train", "--registry", "off"]
    settings = [*base, f"model.source={root / 'weights'}", "model.init=auto", "mode=full"]
    for item in [*settings, f"train.steps={steps}", "train.eval_batches=1", f"train.output_dir={out}", *extra]:
        args += ["--set", item]
    return args


def _published(ck) -> list[int]:
    """Steps of the complete checkpoints (the run validates checksums; a manifest is enough here)."""
    return sorted(int(p.name.split("-")[1]) for p in ck.glob("step-*") if (p / "manifest.json").is_file())


def _evidence(kind: str, ck, at: int, proc, stderr: str) -> bool:
    """What the kill must leave behind, proving it landed where it was aimed."""
    if proc.args[2] == "trainplan":  # one process: its own SIGKILL, and the half-done work on disk
        tmp = list(ck.glob(".tmp-step-*"))
        if proc.returncode != -signal.SIGKILL:
            return False
        if kind == "kill-writing":
            return any(not (t / "manifest.json").exists() for t in tmp)
        if kind == "kill-publishing":
            return any((t / "manifest.json").exists() for t in tmp)
        return bool(list(ck.glob(".del-*")))
    # torchrun: rank 0 died of SIGKILL (the peer it left removes the shared temporary directory)
    if "exitcode  : -9" not in stderr:
        return False
    if kind == "kill-pruning":
        return bool(list(ck.glob(".del-*")))
    return at not in _published(ck) and at - 1 in _published(ck)


@pytest.mark.parametrize("mode", list(MODES))
def test_kill_anywhere_then_resume_auto_is_bitwise(tiny_run, tmp_path, mode):
    nproc, settings, kills = MODES[mode]
    steps = STEPS[mode]
    ref = subprocess.run(_cmd(tiny_run, nproc, tmp_path / "ref", steps, *settings), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = json.loads((tmp_path / "ref" / "record.json").read_text())["final"]

    ck = tmp_path / "ck"
    resume = [f"checkpoint.dir={ck}", "checkpoint.every=1", "checkpoint.resume=auto", "checkpoint.keep_last=2"]
    rng = random.Random(mode)
    landed = {kind: 0 for kind in (*INJECTED, "random")}
    for i in range(kills):
        done = _published(ck)
        latest = done[-1] if done else 0
        kind = "random" if i % 2 else INJECTED[(i // 2) % 3]
        if kind == "kill-pruning" and len(done) < 1:  # step latest+2 prunes only with an older one kept
            kind = "kill-writing"
        at = latest + 2
        assert at <= steps, f"the chain ran out of steps at kill {i}"
        inject = [f'guard.inject=["{kind}@{at}"]'] if kind != "random" else []
        cmd = _cmd(tiny_run, nproc, tmp_path / "run", steps, *settings, *resume, *inject)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kind == "random":  # the whole job at once, as a lost machine: launcher and every rank
            if rng.random() < 0.3:  # in start-up: imports, weights, data, resume
                time.sleep(rng.uniform(0.3, 2.5))
            else:  # in training, evaluation or a write, a few steps on
                target, deadline = latest + rng.randint(1, 3), time.monotonic() + 120
                while proc.poll() is None and time.monotonic() < deadline and max(_published(ck), default=0) < target:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0, 0.05))
            alive = proc.poll() is None
            _kill_tree(proc.pid)
            proc.communicate()
            landed["random"] += alive
        else:
            _, stderr = proc.communicate(timeout=240)
            assert proc.returncode != 0, f"{kind}@{at} did not kill the run"
            assert _evidence(kind, ck, at, proc, stderr), f"{kind}@{at}: no trace where it was aimed\n{stderr[-3000:]}"
            landed[kind] += 1
    assert sum(landed[k] for k in INJECTED) == kills - kills // 2, landed
    assert landed["random"] == kills // 2, landed  # every random kill found the job still running

    final = subprocess.run(
        _cmd(tiny_run, nproc, tmp_path / "run", steps, *settings, *resume), capture_output=True, text=True
    )
    assert final.returncode == 0, final.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["resume"] is not None and record["final"] == expected
    assert not list(ck.glob(".tmp-step-*")) and not list(ck.glob(".del-*"))  # dead writers' leftovers cleaned
    assert len(_published(ck)) == 2  # keep_last, after every pruning the kills interrupted


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant at once (torchrun starts its ranks in sessions of
    their own, so a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
