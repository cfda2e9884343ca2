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

STEPS = 60
INJECTED = ("kill-writing", "kill-publishing", "kill-pruning")
MODES = {  # name: (processes, settings, kills)
    "single": (1, ["batch.micro_batch_size=4"], 20),
    "ddp": (2, ["parallel.strategy=ddp", "batch.micro_batch_size=2"], 15),
    "fsdp2": (2, ["parallel.strategy=zero3", "batch.micro_batch_size=2"], 15),
}


def _cmd(tiny_run, nproc, out, *extra):
    root, base = tiny_run
    launcher = [sys.executable, "-m", "trainplan"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        launcher += ["-m", "trainplan"]
    args = [*launcher, "train"]
    settings = [*base, f"model.source={root / 'weights'}", "model.init=auto", "mode=full"]
    for item in [*settings, f"train.steps={STEPS}", "train.eval_batches=1", f"train.output_dir={out}", *extra]:
        args += ["--set", item]
    return args


def _published(ck) -> list[int]:
    """Steps of the complete checkpoints (the run validates checksums; a manifest is enough here)."""
    return sorted(int(p.name.split("-")[1]) for p in ck.glob("step-*") if (p / "manifest.json").is_file())


def _evidence(kind: str, ck) -> bool:
    """What the kill must leave behind, proving it landed where it was aimed."""
    tmp = list(ck.glob(".tmp-step-*"))
    if kind == "kill-writing":
        return any(not (t / "manifest.json").exists() for t in tmp)
    if kind == "kill-publishing":
        return any((t / "manifest.json").exists() for t in tmp)
    return bool(list(ck.glob(".del-*")))


@pytest.mark.parametrize("mode", list(MODES))
def test_kill_anywhere_then_resume_auto_is_bitwise(tiny_run, tmp_path, mode):
    nproc, settings, kills = MODES[mode]
    ref = subprocess.run(_cmd(tiny_run, nproc, tmp_path / "ref", *settings), capture_output=True, text=True)
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
        assert at <= STEPS, f"the chain ran out of steps at kill {i}"
        inject = [f"guard.inject=[\"{kind}@{at}\"]"] if kind != "random" else []
        cmd = _cmd(tiny_run, nproc, tmp_path / "run", *settings, *resume, *inject)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if kind == "random":  # the whole job at once, as a lost machine: launcher and every rank
            time.sleep(rng.uniform(1.0, 4.0 + 3.0 * (nproc > 1)))
            alive = proc.poll() is None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            landed["random"] += alive
        else:
            assert proc.wait(timeout=240) != 0, f"{kind}@{at} did not kill the run"
            os.killpg(proc.pid, signal.SIGKILL) if _group_alive(proc.pid) else None  # ranks a dead peer left
            assert _evidence(kind, ck), f"{kind}@{at}: the kill left no trace where it was aimed"
            landed[kind] += 1
    assert sum(landed[k] for k in INJECTED) == kills - kills // 2, landed

    final = subprocess.run(_cmd(tiny_run, nproc, tmp_path / "run", *settings, *resume), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["resume"] is not None and record["final"] == expected
    assert not list(ck.glob(".tmp-step-*")) and not list(ck.glob(".del-*"))  # dead writers' leftovers cleaned
    assert len(_published(ck)) == 2  # keep_last, after every pruning the kills interrupted


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
