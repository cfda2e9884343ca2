"""What every subcommand shares: the config flags, one --registry, output (exit codes: trainplan/errors.py)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from trainplan.errors import EXIT_BAD_INPUT, TrainplanError
from trainplan.files import write_atomic
from trainplan.text import ascii_float, ascii_int, error_lines


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its default prints the whole usage first)."""

    def error(self, message: str):
        line = " ".join(error_lines(message))
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {line}; see {self.prog} --help\n")


def prepare(p: argparse.ArgumentParser, module) -> argparse.ArgumentParser:
    """A subcommand's parser: its module's arguments, every type=int / type=float flag reading ASCII
    digits only, and its `run`."""
    p.register("type", int, ascii_int)
    p.register("type", float, ascii_float)
    module.add_args(p)
    p.set_defaults(_run=module.run)
    return p


# Flags shared by every command that takes a RunConfig: (flag, config key, argparse kwargs).
CONFIG_FLAGS: tuple[tuple[str, str, dict], ...] = (
    (
        "--model",
        "model.source",
        {"help": "preset name, HF model dir, config.json or .gguf (default: embedded SmolLM2-135M)"},
    ),
    ("--mode", "mode", {"help": "full | lora | qlora | inference"}),
    (
        "--precision",
        "precision",
        {"help": "auto (fp32 on the CPU, amp-bf16 or amp-fp16 on GPUs) | fp32 | amp-bf16 | amp-fp16 | bf16"},
    ),
    ("--gpus", "hardware.gpus", {"help": "devices, e.g. 8xH100-80GB, A100-80GB,RTX4090, 2x24GiB, cpu, auto"}),
    ("--gpu-mem", "hardware.gpu_mem", {"help": "override every GPU's capacity, e.g. 24GiB"}),
    ("--seq", "batch.seq_len", {"type": int, "help": "sequence length (tokens)"}),
    ("--micro-batch", "batch.micro_batch_size", {"type": int, "help": "sequences per device per micro-step"}),
    ("--grad-accum", "batch.grad_accum_steps", {"type": int, "help": "gradient-accumulation steps"}),
    ("--global-batch", "batch.global_batch_size", {"type": int, "help": "sequences per optimizer step"}),
    ("--strategy", "parallel.strategy", {"help": "ddp | zero1 | zero2 | zero3 (fsdp) | fsdp-grad-op"}),
    ("--tp", "parallel.tp", {"type": int, "help": "tensor-parallel degree"}),
    ("--pp", "parallel.pp", {"type": int, "help": "pipeline-parallel degree (1F1B)"}),
    ("--cp", "parallel.cp", {"type": int, "help": "context-parallel degree (Ulysses: the sequence split over ranks)"}),
    ("--optimizer", "optim.name", {"help": "adamw | adamw-8bit | sgd | sgd-momentum | adafactor"}),
    ("--attention", "memory.attention", {"help": "auto | sdpa | eager"}),
    ("--lora-r", "lora.r", {"type": int, "help": "LoRA rank"}),
    ("--lora-alpha", "lora.alpha", {"type": float, "help": "LoRA alpha (scaling alpha / r)"}),
    ("--lr", "optim.lr", {"type": float, "help": "peak learning rate"}),
    ("--epochs", "train.epochs", {"type": float, "help": "passes over the training split (sets train.steps)"}),
)
SWITCHES = (
    ("--checkpointing", "memory.activation_checkpointing", "activation checkpointing on every layer"),
    ("--offload-optimizer", "parallel.offload_optimizer", "optimizer states in host memory"),
    (
        "--offload-activations",
        "memory.offload_activations",
        "saved tensors of the layers not checkpointed in host memory (--set memory.offload_activations=pinned)",
    ),
)


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        nargs="?",
        help="TOML run config, or a model (preset name, model directory, config.json, .gguf) as --model gives "
        "it (optional; flags and --set override it)",
    )
    for flag, _, kwargs in CONFIG_FLAGS:
        p.add_argument(flag, default=None, **kwargs)
    p.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated LoRA target modules, or a set: attention (the default: q_proj,v_proj or the "
        "fused qkv) or all-linear (every linear layer)",
    )
    for flag, _, text in SWITCHES:
        p.add_argument(flag, action="store_true", default=None, help=text)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set optim.implementation=fused (repeatable)",
    )


def config_from_args(args: argparse.Namespace):
    from trainplan import config as C

    split_positional(args)
    return C.load(args.config, args.set, settings_from_args(args))


def split_positional(args: argparse.Namespace) -> None:
    """`trainplan plan meta-llama/Llama-3.1-8B` or `plan ./my-model`: a positional argument that is not a
    TOML config but names a model becomes --model. A TOML file is still a config."""
    from pathlib import Path

    from trainplan.errors import ConfigError, nearest
    from trainplan.files import refuse_special
    from trainplan.spec.hub import looks_like_hub_id
    from trainplan.spec.model import find_preset, preset_aliases

    given = getattr(args, "config", None)
    if given is None:
        return
    path = Path(given)
    refuse_special(path, "config", "pass a TOML config file, a model directory or a preset")
    if path.suffix == ".toml":  # a config (a missing one is config.load's to report)
        return
    is_model = (
        find_preset(given) is not None
        or looks_like_hub_id(given)
        or given == "default"
        or path.is_dir()
        or path.suffix in (".json", ".gguf")
    )
    if not is_model:
        if path.is_file():  # a config without the .toml suffix
            return
        raise ConfigError(
            "config",
            f"{given!r} is neither a TOML file nor a model",
            f"pass a TOML config, a model directory or a preset ({nearest(given, preset_aliases())}); "
            "or name the model with --model",
        )
    if args.model is not None and args.model != given:
        raise ConfigError("--model", f"two models given ({given!r} and {args.model!r})", "give one")
    args.model, args.config = given, None


def settings_from_args(args: argparse.Namespace) -> dict:
    """The config settings that flags (not --set) give, as dotted keys."""
    settings = {}
    for flag, key, _ in CONFIG_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            settings[key] = value
    for flag, key, _ in SWITCHES:
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            settings[key] = True
    if args.lora_targets is not None:
        settings["lora.target_modules"] = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return settings


def add_registry_arg(p: argparse.ArgumentParser, purpose: str = "where the run is recorded") -> None:
    """The one --registry flag: train, accept, runs and advise read or write the same SQLite file."""
    p.add_argument(
        "--registry",
        default=None,
        help=f"run registry (SQLite), {purpose}; default ~/.cache/trainplan/runs.sqlite; 'off' records nothing",
    )


def _output_path(value: str, *, directory: bool) -> str:
    """An output path, checked before any work: not empty, no control character (a newline or an escape
    sequence would name a file no one can type), and a file output not written as a directory ('x/')."""
    from trainplan.config.schema import CONTROL_IN_PATH
    from trainplan.text import clip

    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    if m := CONTROL_IN_PATH.search(value):
        raise argparse.ArgumentTypeError(
            f"'{clip(value)}' holds a control character ({ascii(m.group())}); give a path of printable characters"
        )
    if not directory and value.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"'{clip(value)}' names a directory; give a file in it, e.g. {value}out.txt")
    return value


def output_file(value: str) -> str:
    """argparse type of a file a command writes (-o, --out)."""
    return _output_path(value, directory=False)


def output_dir(value: str) -> str:
    """argparse type of a directory a command writes (export -o, --output-dir)."""
    return _output_path(value, directory=True)


def seed(value: str) -> int:
    """argparse type of a seed: an integer from 0 to 2^53, as train.seed (past it, not exact as a float)."""
    from trainplan.text import ascii_int, clip

    try:
        n = ascii_int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{clip(value, 40)}' is not an integer; give e.g. 0") from None
    if not 0 <= n <= 2**53:
        raise argparse.ArgumentTypeError(f"{clip(value, 40)} is outside 0 to 2^53; give e.g. 0")
    return n


def add_output_args(p: argparse.ArgumentParser) -> None:
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON (schema trainplan.plan/1, docs/ledger-schema.md)")
    fmt.add_argument("--markdown", action="store_true", help="a Markdown table")
    p.add_argument("--output", "-o", type=output_file, help="write to this file (atomically) instead of stdout")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 on TIGHT too (the tensors fit, but not the verdict's margin: the run may run out of memory)",
    )


def emit(args: argparse.Namespace, text: str) -> None:
    if getattr(args, "output", None):
        write_output(args.output, text if text.endswith("\n") else text + "\n", "--output")
    else:
        print(text)


def write_output(path, text: str, flag: str) -> None:
    """A file the user named, written atomically; a failure is one line naming the flag and the path they gave
    (never the temporary sibling the write goes through)."""
    try:
        write_atomic(path, text)
    except OSError as e:
        raise TrainplanError(
            f"{flag}: cannot write {str(path)!r} ({e.strerror or e}); give a file path in a writable directory"
        ) from None


def add_logging_args(p: argparse.ArgumentParser) -> None:
    """--quiet / --verbose: the level of the `trainplan` logger, where progress goes."""
    level = p.add_mutually_exclusive_group()
    level.add_argument("--quiet", "-q", action="store_true", help="no progress lines; warnings and errors only")
    level.add_argument(
        "--verbose", "-v", action="store_true", help="a progress line for every step, and libraries' own warnings"
    )


class _StderrHandler(logging.Handler):
    """Timestamped lines on stderr (looked up at each line, so a replaced stderr is honoured); on a
    terminal through tqdm.write, which keeps a progress bar intact below the line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text, stream = self.format(record), sys.stderr
            if stream.isatty():
                from tqdm import tqdm

                tqdm.write(text, file=stream)
            else:
                stream.write(text + "\n")
                stream.flush()
        except Exception:
            self.handleError(record)


def setup_logging(args: argparse.Namespace) -> None:
    """The `trainplan` logger for a command with add_logging_args: INFO by default, WARNING with
    --quiet, DEBUG with --verbose; libraries are quietened unless --verbose."""
    verbose, quiet = getattr(args, "verbose", False), getattr(args, "quiet", False)
    logger = logging.getLogger("trainplan")
    for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:  # main() run twice in one process
        logger.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    logger.propagate = False
    if not verbose:
        quiet_libraries()


# what transformers and huggingface_hub read as they are imported: their logging at ERROR, no progress bars
QUIET_ENVIRONMENT = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_libraries() -> None:
    """transformers' and huggingface_hub's logging and progress bars off, without importing them (issue 47:
    a command that never loads a model, verify-resume's parent, pays nothing): not yet imported, each
    reads these variables as it is imported (and the processes this one starts inherit them); imported
    already (a test's process, a second command in one process), their own switches, the environment
    left alone."""
    import warnings

    if "transformers" in sys.modules:
        transformers = sys.modules["transformers"]
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()  # huggingface_hub's bars too
    else:
        os.environ.update(QUIET_ENVIRONMENT)
        if "huggingface_hub" in sys.modules:
            sys.modules["huggingface_hub"].utils.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def warn(command: str, text: str) -> None:
    print(f"trainplan {command}: warning: {text}", file=sys.stderr)


MAX_NPROC = 1024  # ranks one torchrun --standalone launch starts on this machine


def check_nproc(value: int) -> None:
    if isinstance(value, bool) or not 1 <= value <= MAX_NPROC:
        raise TrainplanError(f"--nproc: must be between 1 and {MAX_NPROC} (got {value}); e.g. --nproc 2")


def check_fraction(flag: str, value: float, *, zero_ok: bool = False, example: str = "0.05") -> None:
    """A float flag in (0, 1) ([0, 1) with zero_ok), refusing nan."""
    low_ok = value >= 0 if zero_ok else value > 0
    if not (low_ok and value < 1):  # nan fails both comparisons
        interval = "[0, 1)" if zero_ok else "(0, 1)"
        raise TrainplanError(f"{flag}: must be in {interval} (got {value}); e.g. {flag} {example}")


def os_error_text(e: BaseException) -> str:
    """One line for an OS or decoding error on a path the user gave, with what to do."""
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 text file"
    name = f" {e.filename!r}" if getattr(e, "filename", None) else ""
    fixes = {
        errno.ENOSPC: "free space on that filesystem, or write elsewhere",
        errno.EROFS: "the filesystem is read-only: write elsewhere",
        errno.EACCES: "check its permissions, or write elsewhere",
        errno.EPERM: "check its permissions, or write elsewhere",
        errno.ENOENT: "check the path",
        errno.EISDIR: "give a file, not a directory",
        errno.ENOTDIR: "a part of the path is a file, not a directory",
    }
    fix = fixes.get(getattr(e, "errno", None), "check the path")
    return f"{e.strerror or type(e).__name__}:{name}; {fix}".replace("\n", " ")


def save_traceback() -> str:
    """Write the current exception's traceback to a file; returns its path."""
    import os
    import tempfile
    import time
    import traceback

    text = traceback.format_exc()
    for root in (os.path.expanduser("~/.cache/trainplan/tracebacks"), tempfile.gettempdir()):
        try:
            os.makedirs(root, exist_ok=True)
            path = os.path.join(root, f"trainplan-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return "not saved: no writable directory"


def error_text(e: Exception) -> tuple[bool, str]:
    """(whether it is the user's, its text) of an error as every command reports it: the user's (bad
    input, a path that cannot be read) in its own words, one line a problem; a bug in one line, its
    traceback saved to a file."""
    if isinstance(e, TrainplanError):
        return True, str(e)
    if isinstance(e, OSError | UnicodeDecodeError):  # a path the user named: missing, unreadable, full, not text
        return True, os_error_text(e)
    where = save_traceback()
    first = str(e).splitlines()[0] if str(e) else ""
    return False, f"internal error: {type(e).__name__}: {first} (traceback: {where}; please report it)"
