"""`trainplan plan`: the analytic per-device ledger. Imports no torch (but to tokenize `--data`)."""

from __future__ import annotations

import argparse
import json

from trainplan.commands._common import add_config_args, add_output_args, config_from_args, emit
from trainplan.text import is_terminal

HELP = (
    "per-device memory ledger: will it fit, on each device, and why "
    "(exit 0 FITS or TIGHT, 1 DOES NOT FIT or TIGHT with --strict, 2 bad input)"
)


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--data",
        default=None,
        help="plan from this training data (data.source): tokenize it (cached), pack it and walk the sampler "
        "as train will, and plan the run's widest micro-batch",
    )
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    from trainplan.plan.ledger import render_markdown, render_table

    ledger = ledger_of(args)
    if args.json:
        emit(args, json.dumps(ledger.to_json(), indent=1))
    elif args.markdown:
        emit(args, render_markdown(ledger))
    else:
        emit(args, render_table(ledger, terminal=is_terminal(args.output)))
    return ledger.exit_code_for(strict=args.strict)


def ledger_of(args: argparse.Namespace):
    """The plan `trainplan plan` prints for these arguments (`trainplan ui` asks the same), with the
    nearest step that fits where it does not."""
    from trainplan.plan.analytic import plan

    if args.data is not None:  # the run's own micro-batches (plan/from_data.py); tokenizing imports torch
        from trainplan.config import toml_literal
        from trainplan.plan import from_data

        args.set.insert(0, f"data.source={toml_literal(args.data)}")
        cfg = config_from_args(args)
        ledger = from_data.plan(cfg)
        cfg = from_data.at_widest(cfg, ledger.data)
    else:
        cfg = config_from_args(args)
        ledger = plan(cfg)
    if ledger.state != "FITS":
        from trainplan.advise import nearest

        step = nearest.nearest(cfg)
        ledger.next_step = {"text": nearest.text(step, cfg), **(step.to_json() if step else {})}
    return ledger
