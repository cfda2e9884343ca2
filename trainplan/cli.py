"""The `trainplan` command: the COMMANDS table, the parser and main. Each subcommand lives in
trainplan/commands/<name>.py with `add_args(p)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from trainplan import startup
from trainplan.commands._common import Parser, error_text, prepare
from trainplan.errors import EXIT_BAD_INPUT, EXIT_CODES_HELP, EXIT_INTERNAL, EXIT_STOPPED
from trainplan.text import error_lines

# name -> module under trainplan/commands/, in the order `trainplan --help` lists them
COMMANDS: dict[str, str] = {
    "plan": "plan",
    "advise": "advise",
    "train": "train",
    "verify-resume": "verify_resume",
    "accept": "accept",
    "runs": "runs",
    "export": "export",
    "generate": "generate",
    "trace": "trace",
    "launch": "launch",
    "devices": "devices",
    "ui": "ui",
    "settings": "settings",
    "config": "settings",  # `trainplan config --show [CONFIG]`: the same listing, a file's values beside the defaults
}

# commands whose run releases the collector itself once its model is built (run/loop.py); every other
# command's process collects as usual from the start of its run (trainplan/startup.py)
HELD_THROUGH_START_UP = ("train", "accept")


def command(name: str):
    """The module of one subcommand (imported on demand: `plan` never imports torch)."""
    return importlib.import_module(f"trainplan.commands.{COMMANDS[name]}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; `only`: the one command a command line names, whose module alone is imported
    (the others are bare names, for argparse's choices): `trainplan train` does not import `advise`'s
    search or `devices`' probes before its first step (issue 47)."""
    from trainplan import __version__

    parser = Parser(prog="trainplan", description="Plan, run and verify LLM fine-tuning.", epilog=EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"trainplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        module = command(name)
        prepare(sub.add_parser(name, help=module.HELP, description=module.HELP, epilog=EXIT_CODES_HELP), module)
    return parser


def named_command(argv: list[str]) -> str | None:
    """The command a command line names, where its first word is one (the top level's own flags,
    --help and --version, need the whole parser)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(named_command(argv)).parse_args(argv)
    except SystemExit as e:  # --help (0), or a flag argparse could not read (2, one line)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    # bitsandbytes' CPU backend warns when peft imports it, about an optional `kernels` package
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if args.command not in HELD_THROUGH_START_UP:
        startup.release()
    return leave_ranks(run_command(args))


def entry() -> int:
    """A trainplan process's own start (the `trainplan` script, `python -m trainplan`): main, with the
    collector held through start-up (trainplan/startup.py). Tests call main in their own process."""
    startup.hold()
    code = main()
    startup.leave()
    return code


def leave_ranks(code: int) -> int:
    """A rank of a multi-process run that ends on an error exits at once with its code: its process
    group is still up (a peer may be gone), and gloo can abort at interpreter exit, which would turn
    exit 2 into 134. A run that ended well has left through run/dist.finish already."""
    tdist = sys.modules.get("torch.distributed")
    if tdist is None or not tdist.is_available() or not tdist.is_initialized() or tdist.get_world_size() < 2:
        return code
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_command(args) -> int:
    """The command's exit code; a user's error is one line per problem, a bug one line and a saved traceback."""
    try:
        return args._run(args)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a training loop
        print(f"trainplan {args.command}: interrupted", file=sys.stderr)
        return EXIT_STOPPED
    except BrokenPipeError:  # `trainplan plan --markdown | head`: the reader left; end quietly, as `yes | head` does
        import os

        try:  # Python's own final flush of stdout must not fail too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 128 + 13  # SIGPIPE
    except Exception as e:
        users, text = error_text(e)
        if not users:  # a bug: one line, the traceback kept in a file
            print(f"trainplan {args.command}: {text}", file=sys.stderr)
            return EXIT_INTERNAL
        for line in error_lines(text):  # one line a problem (a config can have several)
            print(f"trainplan {args.command}: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
