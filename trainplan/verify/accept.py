"""`trainplan accept`: the acceptance run, one verdict from six recorded checks.

(a) mode contract  (b) memory, plan vs measured per device  (c) training step: finite, and the
loss falls when overfitting one fixed batch  (d) quality: the held-out metric before and after,
with settings and training time  (e) resume: verify-resume at a small scale  (f) instability:
a scan of the run's loss and grad-norm history.

Each check records its evidence; the verdict is PASS only when every check that applies passed.
A run that succeeds is not yet a useful result (d), a server's total memory says nothing about
placement (b, per device, never pooled), and a checkpoint counts only when the code can load it
and continue (e).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import time
from pathlib import Path

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.run.progress import Progress
from trainplan.verify.checks import (
    Check,
    check_contract,
    check_instability,
    check_memory,
    check_quality,
    check_step,
)

# The default configuration: the embedded default's LoRA demo, shipped in the package.
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo-lora.toml"
TOLERANCE = 0.05  # of the measured peak allocated, per device


def perturbed(ledger, perturb: dict[str, float] | None):
    """The plan with components scaled (a test hook: proves the memory check can fail)."""
    if not perturb:
        return ledger
    known = {c for d in ledger.devices for ph in d.phases.values() for c in ph}
    for comp in perturb:
        if comp not in known:
            raise ConfigError("--perturb-plan", f"no component {comp!r} in the plan", f"use one of {sorted(known)}")
    devices = [
        dataclasses.replace(
            d,
            phases={ph: {c: int(v * perturb.get(c, 1.0)) for c, v in comps.items()} for ph, comps in d.phases.items()},
        )
        for d in ledger.devices
    ]
    return dataclasses.replace(ledger, devices=devices)


# ---- (e) resume -----------------------------------------------------------------------------


def check_resume(
    config_file: Path, workdir: Path, *, steps: int, at: int, nproc: int, mode: str, progress: Progress | None = None
) -> Check:
    if mode == "inference":
        return Check("resume", "Resume", None, "inference: no optimizer state or progress to resume", {})
    from trainplan.verify.resume import verify

    small = ["train.eval_batches=1", "train.eval_every=0", "train.measure_memory=false"]
    args = [str(config_file), *(x for item in small for x in ("--set", item))]
    try:
        result = verify(args, steps=steps, at=at, workdir=workdir, nproc=nproc, progress=progress)
    except RuntimeError as e:
        return Check("resume", "Resume", False, str(e), {})
    failed = [k for k, ok in result["checks"].items() if not ok]
    summary = f"N={steps} uninterrupted vs stop at k={at} + resume in a fresh process: " + (
        "bitwise equal (loss, grad norm, LR, next batch, weights and optimizer hashes)"
        if not failed
        else f"differs in {', '.join(failed)}; largest deviation {result['max_deviation']}"
    )
    return Check("resume", "Resume", result["passed"], summary, result)


def samples(record) -> list[dict]:
    """Greedy completions of held-out prompts by the run's base and its result (the report shows them)."""
    from trainplan.run import generate

    return generate.run_samples(record.config, record.result)


def _device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


# ---- the run --------------------------------------------------------------------------------


class _Checks:
    """The six checks in order, each a stage of `progress` (`accept [5/6] resume: ... ...`, then
    its verdict and how long it took, the runs it needed included)."""

    KEYS = ("contract", "memory", "step", "quality", "resume", "instability")

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.done: list[Check] = []
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def running(self, key: str, doing: str):
        """Yields `done(check)`, which the body calls with the check's result."""
        assert key == self.KEYS[len(self.done)], key
        t0 = time.perf_counter()
        with self.progress.stage(f"accept [{len(self.done) + 1}/{len(self.KEYS)}] {key}", doing) as stage:
            yield self.done.append
            (check,) = self.done[-1:]
            assert check.key == key, (check.key, key)
            verdict = {True: "ok", False: "FAIL", None: "n/a"}[check.passed]
            stage.result = f"{verdict} - {check.summary}"
        self.seconds[key] = time.perf_counter() - t0


def _unpacked(cfg: C.RunConfig) -> bool:
    from trainplan.run import sources

    return cfg.mode != "inference" and sources.packing(cfg.data)[0] == "none"


def widest_measured(cfg: C.RunConfig) -> C.RunConfig:
    """One document a row (data.packing "none"): every step has its own shape, so the run measures the
    step the data plan names as the widest (plan/from_data.py), unless train.measure_step names one."""
    if not _unpacked(cfg) or cfg.train.measure_step:
        return cfg
    from trainplan.plan import from_data

    step = from_data.profile(cfg)["widest"]["step"]
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, measure_step=step))


def memory_plan(cfg: C.RunConfig, record) -> object:
    """The plan the measured step is checked against: at that step's shape where shapes vary (its widest
    micro-batch's tokens a row, as the record's step entry gives them)."""
    from trainplan.plan import analytic

    entry = next((e for e in record.steps if e["step"] == (record.memory or {}).get("step")), None)
    if not _unpacked(cfg) or entry is None or "shapes" not in entry:
        return analytic.plan(cfg)
    width = max(shape[1] for shape in entry["shapes"])
    return analytic.plan(cfg.at_seq_len(width))


def accept(
    cfg: C.RunConfig,
    *,
    out_dir: Path,
    tolerance: float = TOLERANCE,
    perturb: dict[str, float] | None = None,
    resume_steps: int = 4,
    resume_at: int = 2,
    overfit_steps: int = 6,
    nproc: int = 1,
    progress: Progress | None = None,
) -> dict:
    """Run the checks in order, each a stage of `progress`; returns the result (also the input
    of the report)."""
    from trainplan.plan import analytic
    from trainplan.plan.bill import preflight_bill
    from trainplan.run import loop
    from trainplan.run.record import RunRecord
    from trainplan.run.record import write as write_record
    from trainplan.verify.resume import run_train

    t0 = time.perf_counter()
    cfg, note = analytic.choose_checkpointing(cfg)  # the run and the plan it is checked against use the choice
    if note:
        print(f"trainplan accept: {note}", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    for own in ("train", "overfit"):  # accept's own runs start clean in a reused output dir
        shutil.rmtree(out_dir / own / "checkpoints", ignore_errors=True)
    main_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(out_dir / "train")))
    main_cfg = widest_measured(main_cfg)
    config_file = out_dir / "config.toml"
    config_file.write_text(C.to_toml(main_cfg))
    steps = "inference" if cfg.mode == "inference" else f"training {cfg.train.steps} steps"
    checks = _Checks(progress or Progress.off())

    with checks.running("contract", f"the measured run, {steps}") as done:  # the evidence of four checks
        if nproc > 1:
            record = RunRecord.from_json(run_train([str(config_file)], out_dir / "train", nproc=nproc))
        else:
            record, _ = loop.run(main_cfg, progress=checks.progress, bill=preflight_bill)
        with checks.progress.stage("samples", "greedy completions by the base and the result"):
            record.samples = samples(record)
        write_record(record, out_dir / "train")
        done(check_contract(record))

    with checks.running("memory", "plan vs measured, per device") as done:
        ledger = perturbed(memory_plan(C.from_dict(record.config), record), perturb)
        done(check_memory(record, ledger, tolerance))

    with checks.running("step", f"overfitting one batch, training {overfit_steps} steps") as done:
        overfit = None
        if cfg.mode != "inference":
            fit_cfg = dataclasses.replace(
                main_cfg,
                train=dataclasses.replace(
                    main_cfg.train,
                    steps=overfit_steps,
                    overfit_batches=1,
                    eval_batches=1,
                    eval_every=0,
                    stop_after=0,
                    measure_memory=False,
                    output_dir=str(out_dir / "overfit"),
                ),
                checkpoint=dataclasses.replace(main_cfg.checkpoint, every=0, resume=""),
                data=main_cfg.data,
            )
            if nproc > 1:  # on the run's own ranks: a tp layout does not run on one process
                fit_file = out_dir / "overfit.toml"
                fit_file.write_text(C.to_toml(fit_cfg))
                overfit = RunRecord.from_json(run_train([str(fit_file)], out_dir / "overfit", nproc=nproc))
            else:
                overfit, _ = loop.run(fit_cfg, progress=checks.progress)
                write_record(overfit, out_dir / "overfit")
        done(check_step(record, overfit))

    with checks.running("quality", "held-out metric before and after") as done:
        done(check_quality(record))

    doing = f"{resume_steps} steps uninterrupted vs stopped at {resume_at} and resumed, 3 fresh processes"
    with checks.running("resume", doing) as done:
        done(
            check_resume(
                config_file,
                out_dir / "resume",
                steps=resume_steps,
                at=resume_at,
                nproc=nproc,
                mode=cfg.mode,
                progress=checks.progress,
            )
        )

    with checks.running("instability", "the loss and grad-norm history") as done:
        done(check_instability(record))

    passed = all(c.passed is not False for c in checks.done)
    failing = [c for c in checks.done if c.passed is False]
    ordered = failing + [c for c in checks.done if c.passed is not False]
    return {
        "schema": "trainplan.accept/1",
        "verdict": "PASS" if passed else "FAIL",
        "failing": [f"{c.name}: {c.summary}" for c in failing],
        "checks": [c.to_json() | {"seconds": checks.seconds[c.key]} for c in ordered],
        "order": [c.key for c in checks.done],
        "plan": ledger.to_json(),
        "perturbed": perturb or {},
        "record": {k: v for k, v in record.to_json().items() if k != "memory"},
        "memory": record.memory,
        "device_name": _device_name(record.hardware["device"]),
        "seconds": time.perf_counter() - t0,
        "out_dir": str(out_dir),
    }
