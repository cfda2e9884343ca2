"""The `trainplan` command: the COMMANDS table, the parser and main. Each subcommand lives in
trainplan/commands/<name>.py with `add_args(p)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from trainplan.commands._common import EXIT_BAD_INPUT
from trainplan.errors import TrainplanError

# name -> module under trainplan/commands/, in the order `trainplan --help` lists them
COMMANDS: dict[str, str] = {
    "plan": "plan",
    "advise": "advise",
    "train": "train",
    "verify-resume": "verify_resume",
    "accept": "accept",
    "runs": "runs",
    "trace": "trace",
    "devices": "devices",
}


def command(name: str):
    """The module of one subcommand (imported on demand: `plan` never imports torch)."""
    return importlib.import_module(f"trainplan.commands.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainplan", description="Plan, run and verify LLM fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = command(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_args(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # bitsandbytes' CPU backend warns when peft imports it, about an optional `kernels` package
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        return args._run(args)
    except TrainplanError as e:
        print(f"trainplan {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
