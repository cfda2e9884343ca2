"""SIGKILL the training process at 20 points, half of them while a checkpoint is being written;
`--resume auto` must carry on from the newest complete checkpoint, with no manual clean-up, and
end with the same weights as an uninterrupted run."""

import json
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

KILLS = 20


def _cmd(tiny_run, out, *extra):
    root, base = tiny_run
    args = [sys.executable, "-m", "trainplan", "train"]
    for item in [*base, "mode=full", "train.steps=40", "train.eval_batches=1", f"train.output_dir={out}", *extra]:
        args += ["--set", item]
    return args


@pytest.mark.multiprocess
def test_sigkill_anywhere_then_resume_auto(tiny_run, tmp_path):
    ref = subprocess.run(_cmd(tiny_run, tmp_path / "ref"), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    expected = json.loads((tmp_path / "ref" / "record.json").read_text())["final"]

    ck = tmp_path / "ck"
    cmd = _cmd(
        tiny_run,
        tmp_path / "run",
        f"checkpoint.dir={ck}",
        "checkpoint.every=1",
        "checkpoint.resume=auto",
        "checkpoint.keep_last=2",
    )
    rng = random.Random(0)
    during_write = 0
    for kill in range(KILLS):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if kill % 2 == 0:  # wait for this process's checkpoint write, then kill inside it
            mine = f".tmp-step-*-{proc.pid}"
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline and not list(ck.glob(mine)):
                time.sleep(0)
            during_write += bool(list(ck.glob(mine))) and proc.poll() is None
        else:  # anywhere: start-up, training, evaluation, writing
            time.sleep(rng.uniform(2.0, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert during_write >= 3  # some kills really landed inside a checkpoint write

    final = subprocess.run(cmd, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["final"] == expected
    assert not list(ck.glob(".tmp-step-*"))  # dead writes cleaned up by the run itself
