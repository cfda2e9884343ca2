"""`trainplan train`: run the job for real, in one process or on every rank under torchrun.

The loop returns the run record; this command writes it and adds it to the run registry."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainplan.commands._common import (
    add_config_args,
    add_logging_args,
    add_registry_arg,
    config_from_args,
    output_dir,
    setup_logging,
    warn,
)
from trainplan.errors import EXIT_FAILED, EXIT_OK, EXIT_STOPPED

HELP = "run the job for real: full, lora, qlora (CUDA) or inference; single process or under torchrun"


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument("--data", default=None, help='training text: "default" (Python docs), .txt, dir of .txt, .jsonl')
    p.add_argument("--output-dir", default=None, type=output_dir, help="where record.json goes (train.output_dir)")
    add_registry_arg(p)
    add_logging_args(p)


def summary(record) -> list[str]:
    """What `trainplan train` prints of a RunRecord."""
    from trainplan.run.progress import duration

    before, after = record.eval_before, record.eval_after
    contract = record.contract
    lines = [
        f"held-out loss {before['loss']:.4f} -> {after['loss']:.4f}, perplexity {before['perplexity']:.2f} -> "
        f"{after['perplexity']:.2f}, token accuracy {before['token_accuracy']:.3f} -> "
        f"{after['token_accuracy']:.3f}; {len(record.steps)} steps in {duration(record.train_seconds or 0)}, "
        f"run wall time {duration(record.wall_seconds)}",
        f"contract ({contract['mode']}): {'PASS' if contract['passed'] else 'FAIL'} - {contract['detail']}",
        f"record: {Path(record.config['train']['output_dir']) / 'record.json'}",
    ]
    if record.interrupted:
        it = record.interrupted
        lines.append(f"interrupted by {it['signal']} after step {it['step']}: checkpoint and result saved")
    if record.stopped:
        ev = record.stopped
        lines.append(
            f"stopped by the stability guard at step {ev['step']}: {ev['key']} {ev['kind']} ({ev['value']:.4g})"
        )
    return lines


def register(record, registry_arg: str | None, device: str) -> None:
    """Add the run to the registry; a registry that cannot be written is a warning, not a failure."""
    from trainplan.verify import registry

    db = registry.path(registry_arg)
    if db is None:
        return
    verdict = "PASS" if record.passed else "FAIL"
    try:
        record.registry_id = registry.add(
            registry.row_from_record(record, kind="train", verdict=verdict, device=device), db
        )
    except Exception as e:  # the run itself succeeded
        warn("train", f"run not registered ({type(e).__name__}: {e})")


def time_vs_estimate(rec) -> dict | None:
    """The step time `advise` would have estimated for this run (its config on its devices, the assumed
    MFU: a registry run calibrates advise's later estimates, not this one) beside the measured median
    step (the first left out: it compiles and creates the optimizer state), and the run's training time
    beside steps x the estimate."""
    import statistics

    from trainplan import config as C
    from trainplan.advise import estimate
    from trainplan.resolve import resolve

    seconds = [s["seconds"] for s in rec.steps[1:] if "seconds" in s]
    if not seconds or rec.train_seconds is None:
        return None
    try:
        est = estimate.estimate(resolve(C.from_dict(rec.config)))
    except (ValueError, KeyError) as e:  # a layout or device the estimator does not know: the record says so
        return {"error": f"{type(e).__name__}: {e}"}
    measured = statistics.median(seconds)
    return {
        "estimated_step_seconds": est.step_s,
        "measured_step_seconds": measured,
        "measured_over_estimated": measured / est.step_s if est.step_s else None,
        "estimated_train_seconds": est.step_s * len(rec.steps),
        "measured_train_seconds": rec.train_seconds,
        "mfu": est.mfu,
        "mfu_source": est.mfu_source,
    }


def execute(cfg, registry_arg: str | None = None, *, quiet: bool = False):
    """Run cfg, register the run and write its record (on the main rank); (record, env)."""
    from trainplan.plan.analytic import choose_checkpointing
    from trainplan.plan.bill import preflight_bill
    from trainplan.run import loop, record

    cfg, note = choose_checkpointing(cfg)  # "auto": the planner chooses, every rank the same
    if note and os.environ.get("RANK", "0") == "0":
        print(f"trainplan train: {note}", file=sys.stderr)

    rec, env = loop.run(cfg, quiet=quiet, bill=preflight_bill)  # each rank's preflight checks the plan's bill
    if env.is_main:  # the record first: the registry never lists a run whose record was not written
        rec.time_estimate = time_vs_estimate(rec)
        out = Path(rec.config["train"]["output_dir"])
        record.write(rec, out)
        register(rec, registry_arg, record.device_name(env))
        if rec.registry_id is not None:
            record.write(rec, out)
    return rec, env


def run(args: argparse.Namespace) -> int:
    from trainplan.config import toml_literal
    from trainplan.run import dist

    setup_logging(args)
    for flag, key in (("steps", "train.steps"), ("data", "data.source"), ("output_dir", "train.output_dir")):
        if getattr(args, flag) is not None:
            args.set.insert(0, f"{key}={toml_literal(getattr(args, flag))}")
    rec, env = execute(config_from_args(args), args.registry)
    if env.is_main:
        print("\n".join(summary(rec)))
    if rec.interrupted or rec.stopped:  # a signal, or the guard: a checkpoint to resume from is kept
        return dist.finish(env, EXIT_STOPPED)
    return dist.finish(env, EXIT_OK if rec.passed else EXIT_FAILED)
