"""`trainplan verify-resume`: uninterrupted vs stopped at k and resumed, in fresh processes, compared."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainplan.commands._common import (
    add_config_args,
    add_logging_args,
    check_nproc,
    config_from_args,
    settings_from_args,
    setup_logging,
)
from trainplan.config import toml_literal
from trainplan.errors import TrainplanError

HELP = "prove that resuming continues the same run: uninterrupted vs stopped at k and resumed, compared"


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=int, default=6, help="N: steps of the uninterrupted run")
    p.add_argument("--at", type=int, default=3, help="k: the interrupted run stops and checkpoints here")
    p.add_argument("--tolerance", type=float, default=0.0, help="largest allowed per-step deviation; 0 = bitwise")
    p.add_argument("--workdir", default="runs/verify-resume", help="where the three runs write")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --standalone) for DDP / ZeRO-1")
    p.add_argument("--json", action="store_true")
    add_logging_args(p)


def run(args: argparse.Namespace) -> int:
    setup_logging(args)
    config_from_args(args)  # validate before starting three processes

    # every flag reaches the three runs as --set, ahead of the user's own --set (which win)
    flags = [f"{key}={toml_literal(value)}" for key, value in settings_from_args(args).items()]
    passthrough = ([args.config] if args.config else []) + [x for item in flags + args.set for x in ("--set", item)]
    check_nproc(args.nproc)
    if not (args.tolerance >= 0 and args.tolerance < float("inf")):  # nan fails both
        raise TrainplanError(f"--tolerance: must be a finite number >= 0 (got {args.tolerance}); 0 means bitwise")
    if args.steps < 2:
        raise TrainplanError(f"--steps: must be >= 2 (got {args.steps}); e.g. --steps 6")
    if not 0 < args.at < args.steps:
        raise TrainplanError(f"--at: must be between 1 and {args.steps - 1} (got {args.at}); choose k < N")
    from trainplan.run.progress import Progress
    from trainplan.verify.resume import verify

    try:
        with Progress(grace_s=0) as progress:  # the input is checked: nothing to hold back
            result = verify(
                passthrough,
                steps=args.steps,
                at=args.at,
                workdir=Path(args.workdir),
                tolerance=args.tolerance,
                nproc=args.nproc,
                progress=progress,
            )
    except RuntimeError as e:
        raise TrainplanError(f"verify-resume: {e}") from None
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(
            f"verify-resume: {'PASS' if result['passed'] else 'FAIL'} (N={args.steps}, k={args.at}, "
            f"tolerance {args.tolerance or 'bitwise'})"
        )
        for name, ok in result["checks"].items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
        print("  largest per-step deviation: " + ", ".join(f"{k} {v:.3g}" for k, v in result["max_deviation"].items()))
    return 0 if result["passed"] else 1
