"""verify-resume: prove, for a given config, that resuming continues the same run.

Three runs of the same config, each in a fresh process: (1) N steps uninterrupted; (2) k steps,
checkpoint, stop; (3) resume from that checkpoint and run to N. The resumed run must reproduce
the uninterrupted one: per-step loss, grad norm and LR; the sample ids of the next batch; hashes
of the final weights and optimizer state. On the CPU in deterministic mode the match is bitwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from trainplan.run.progress import Progress


def run_train(args: list[str], out: Path, *extra: str, nproc: int = 1) -> dict:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    # these are verification runs, not the user's: they stay out of the run registry, and their
    # output is read only for an error (the caller reports progress)
    cmd = [*launcher, "-m", "trainplan", "train", *args, "--registry", "off", "--quiet"]
    cmd += ["--set", f"train.output_dir={str(out)!r}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and "torch.distributed" not in ln]
        cause = [ln for ln in lines if ln.startswith(("trainplan ", "contract (")) and ":" in ln or "Error:" in ln]
        raise RuntimeError(
            f"run failed ({' '.join(extra) or 'uninterrupted'}, exit {proc.returncode}): "
            + ((cause or lines or ["no output"])[-1]).strip()
        )
    return json.loads((out / "record.json").read_text())


def verify(
    train_args: list[str],
    *,
    steps: int,
    at: int,
    workdir: Path,
    tolerance: float = 0.0,
    nproc: int = 1,
    progress: Progress | None = None,
) -> dict:
    """Run the three runs and compare them. tolerance 0 means bitwise. Each run is a stage of
    `progress`."""
    if not 0 < at < steps:
        raise ValueError(f"--at must be between 1 and {steps - 1} (got {at})")
    progress = progress or Progress.off()
    base = [*train_args, "--set", f"train.steps={steps}"]
    ckpt = workdir / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)  # verify-resume's own: a reused work dir starts clean
    where = f"in a fresh process{'' if nproc == 1 else f' on {nproc} ranks'}"
    with progress.stage("resume run 1/3", f"uninterrupted, training {steps} steps {where}"):
        full = run_train(base, workdir / "uninterrupted", nproc=nproc)
    with progress.stage("resume run 2/3", f"training {at} steps, checkpoint and stop, {where}"):
        run_train(
            base,
            workdir / "interrupted",
            "--set",
            f"train.stop_after={at}",
            "--set",
            f"checkpoint.every={at}",
            "--set",
            f"checkpoint.dir={str(ckpt)!r}",
            nproc=nproc,
        )
    with progress.stage("resume run 3/3", f"resuming at step {at}, training to {steps} {where}"):
        resumed = run_train(
            base,
            workdir / "resumed",
            "--set",
            "checkpoint.resume='auto'",
            "--set",
            f"checkpoint.dir={str(ckpt)!r}",
            nproc=nproc,
        )
    expected = full["steps"][at:]
    got = resumed["steps"]
    deviations = {}
    for key in ("loss", "grad_norm", "lr"):
        pairs = list(zip((s[key] for s in expected), (s[key] for s in got), strict=False))
        deviations[key] = max((abs(a - b) for a, b in pairs), default=0.0)
    checks = {
        "resumed_from_step": resumed.get("resume", {}).get("step") == at,
        "same_step_count": len(expected) == len(got),
        "per_step_within_tolerance": all(d <= tolerance for d in deviations.values()),
        "next_batch": full["final"]["next_batch"] == resumed["final"]["next_batch"],
        "weights_hash": full["final"]["weights_hash"] == resumed["final"]["weights_hash"],
        "optimizer_hash": full["final"]["optimizer_hash"] == resumed["final"]["optimizer_hash"],
    }
    if tolerance > 0:  # hashes can only match bitwise
        checks.pop("weights_hash")
        checks.pop("optimizer_hash")
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "max_deviation": deviations,
        "tolerance": tolerance,
        "steps": steps,
        "at": at,
        "train_sequences": full["data"]["train_sequences"],
        "final": {"uninterrupted": full["final"], "resumed": resumed["final"]},
    }
