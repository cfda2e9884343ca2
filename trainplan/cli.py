"""The `trainplan` command. Subcommands live in one table, COMMANDS."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainplan.errors import TrainplanError

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# Flags shared by every command that takes a RunConfig: (flag, config key, argparse kwargs).
CONFIG_FLAGS: tuple[tuple[str, str, dict], ...] = (
    (
        "--model",
        "model.source",
        {"help": "preset name, HF model dir, config.json or .gguf (default: embedded SmolLM2-135M)"},
    ),
    ("--mode", "mode", {"help": "full | lora | qlora | inference"}),
    ("--precision", "precision", {"help": "fp32 | amp-bf16 | amp-fp16 | bf16"}),
    ("--gpus", "hardware.gpus", {"help": "devices, e.g. 8xH100-80GB, A100-80GB,RTX4090, 2x24GiB, cpu, auto"}),
    ("--gpu-mem", "hardware.gpu_mem", {"help": "override every GPU's capacity, e.g. 24GiB"}),
    ("--seq", "batch.seq_len", {"type": int, "help": "sequence length (tokens)"}),
    ("--micro-batch", "batch.micro_batch_size", {"type": int, "help": "sequences per device per micro-step"}),
    ("--grad-accum", "batch.grad_accum_steps", {"type": int, "help": "gradient-accumulation steps"}),
    ("--global-batch", "batch.global_batch_size", {"type": int, "help": "sequences per optimizer step"}),
    ("--strategy", "parallel.strategy", {"help": "ddp | zero1 | zero2 | zero3 (fsdp) | fsdp-grad-op"}),
    ("--tp", "parallel.tp", {"type": int, "help": "tensor-parallel degree"}),
    ("--pp", "parallel.pp", {"type": int, "help": "pipeline-parallel degree (1F1B)"}),
    ("--optimizer", "optim.name", {"help": "adamw | adamw-8bit | sgd | sgd-momentum | adafactor"}),
    ("--attention", "memory.attention", {"help": "auto | sdpa | eager"}),
    ("--lora-r", "lora.r", {"type": int, "help": "LoRA rank"}),
)
SWITCHES = (
    ("--checkpointing", "memory.activation_checkpointing", "activation checkpointing on every layer"),
    ("--offload-optimizer", "parallel.offload_optimizer", "optimizer states in host memory"),
)


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML run config (optional; flags and --set override it)")
    for flag, _, kwargs in CONFIG_FLAGS:
        p.add_argument(flag, default=None, **kwargs)
    p.add_argument("--lora-targets", default=None, help="comma-separated LoRA target modules (default q_proj,v_proj)")
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

    return C.load(args.config, args.set, settings_from_args(args))


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


def write_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def emit(args: argparse.Namespace, text: str) -> None:
    if getattr(args, "output", None):
        write_atomic(args.output, text if text.endswith("\n") else text + "\n")
    else:
        print(text)


# ---- plan ---------------------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON (schema trainplan.plan/1, docs/ledger-schema.md)")
    fmt.add_argument("--markdown", action="store_true", help="a Markdown table")
    p.add_argument("--output", "-o", help="write to this file (atomically) instead of stdout")


def _plan_run(args: argparse.Namespace) -> int:
    from trainplan.plan.analytic import plan
    from trainplan.plan.ledger import render_markdown, render_table

    ledger = plan(config_from_args(args))
    if args.json:
        emit(args, json.dumps(ledger.to_json(), indent=1))
    elif args.markdown:
        emit(args, render_markdown(ledger))
    else:
        emit(args, render_table(ledger))
    return ledger.exit_code


# ---- trace --------------------------------------------------------------------------------


def _trace_args(p: argparse.ArgumentParser) -> None:
    _plan_args(p)


def render_comparison(rows: list[dict]) -> str:
    from trainplan.plan.ledger import gib

    lines = [f"{'phase':10s} {'group':13s} {'analytic':>12s} {'traced':>12s} {'diff / traced peak':>19s}"]
    for row in rows:
        lines.append(
            f"{row['phase']:10s} {row['group']:13s} {gib(row['analytic']):>12s} {gib(row['traced']):>12s} "
            f"{row['diff_of_peak'] * 100:+18.2f}%"
        )
    return "\n".join(lines)


def _trace_run(args: argparse.Namespace) -> int:
    from trainplan.plan import analytic, traced
    from trainplan.plan.ledger import gib, render_markdown, render_table

    result, resolved = traced.trace(config_from_args(args))
    analytic_ledger = analytic.plan(resolved.cfg, resolved.spec)
    ledger = traced.traced_ledger(result, resolved, analytic_ledger)
    rows = traced.compare(result, analytic_ledger)
    a_dev = analytic_ledger.devices[0]
    diff = 100 * (a_dev.peak_allocated - result.peak_bytes) / result.peak_bytes
    summary = (
        f"peak: analytic {gib(a_dev.peak_allocated)} ({a_dev.peak_phase}) vs traced {gib(result.peak_bytes)} "
        f"({result.peak_phase}): {diff:+.2f}% of traced; traced in {result.seconds:.1f} s, "
        f"max RSS {gib(result.max_rss_bytes)}"
    )
    if args.json:
        doc = ledger.to_json()
        doc["comparison"] = {
            "rows": rows,
            "summary": summary,
            "row_sources": result.rows,
            "analytic_peak_bytes": a_dev.peak_allocated,
            "traced_peak_bytes": result.peak_bytes,
            "seconds": result.seconds,
            "max_rss_bytes": result.max_rss_bytes,
        }
        emit(args, json.dumps(doc, indent=1))
    else:
        body = render_markdown(ledger) if args.markdown else render_table(ledger)
        emit(
            args,
            "\n".join(
                [body, "", "Analytic vs traced (allocated bytes, per phase):", render_comparison(rows), "", summary]
            ),
        )
    return ledger.exit_code


# ---- train --------------------------------------------------------------------------------


def _train_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument("--data", default=None, help='training text: "default" (Python docs), .txt, dir of .txt, .jsonl')
    p.add_argument("--output-dir", default=None, help="where record.json goes (train.output_dir)")


def _train_run(args: argparse.Namespace) -> int:
    import warnings

    import transformers

    from trainplan.run import dist, loop

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)

    from trainplan.config import toml_literal

    for flag, key in (("steps", "train.steps"), ("data", "data.source"), ("output_dir", "train.output_dir")):
        if getattr(args, flag) is not None:
            args.set.insert(0, f"{key}={toml_literal(getattr(args, flag))}")
    record = loop.run(config_from_args(args))
    env = record.pop("_env")
    if env.is_main:
        before, after = record["eval_before"], record["eval_after"]
        steps = len(record["steps"])
        print(
            f"held-out loss {before['loss']:.4f} -> {after['loss']:.4f}, perplexity {before['perplexity']:.2f} -> "
            f"{after['perplexity']:.2f}, token accuracy {before['token_accuracy']:.3f} -> "
            f"{after['token_accuracy']:.3f}; {steps} steps in {record.get('train_seconds', 0):.1f} s "
            f"(wall {record['wall_seconds']:.1f} s)"
        )
        print(
            f"contract ({record['contract']['mode']}): {'PASS' if record['contract']['passed'] else 'FAIL'} - "
            f"{record['contract']['detail']}"
        )
        print(f"record: {Path(record['config']['train']['output_dir']) / 'record.json'}")
    return dist.finish(env, 0 if record["contract"]["passed"] else 1)


# ---- verify-resume -------------------------------------------------------------------------


def _verify_resume_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=int, default=6, help="N: steps of the uninterrupted run")
    p.add_argument("--at", type=int, default=3, help="k: the interrupted run stops and checkpoints here")
    p.add_argument("--tolerance", type=float, default=0.0, help="largest allowed per-step deviation; 0 = bitwise")
    p.add_argument("--workdir", default="runs/verify-resume", help="where the three runs write")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --standalone) for DDP / ZeRO-1")
    p.add_argument("--json", action="store_true")


def _verify_resume_run(args: argparse.Namespace) -> int:
    from trainplan.config import toml_literal
    from trainplan.verify.resume import verify

    config_from_args(args)  # validate before starting three processes

    # every flag reaches the three runs as --set, ahead of the user's own --set (which win)
    flags = [f"{key}={toml_literal(value)}" for key, value in settings_from_args(args).items()]
    passthrough = ([args.config] if args.config else []) + [x for item in flags + args.set for x in ("--set", item)]
    if not 0 < args.at < args.steps:
        raise TrainplanError(f"--at: must be between 1 and {args.steps - 1} (got {args.at}); choose k < N")
    try:
        result = verify(
            passthrough,
            steps=args.steps,
            at=args.at,
            workdir=Path(args.workdir),
            tolerance=args.tolerance,
            nproc=args.nproc,
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


COMMANDS: dict[str, Command] = {
    "plan": Command(
        "per-device memory ledger: will it fit, on each device, and why (exit 0 fits, 1 not, 2 bad input)",
        _plan_args,
        _plan_run,
    ),
    "train": Command(
        "run the job for real: full, lora, qlora (CUDA) or inference; single process or under torchrun",
        _train_args,
        _train_run,
    ),
    "verify-resume": Command(
        "prove that resuming continues the same run: uninterrupted vs stopped at k and resumed, compared",
        _verify_resume_args,
        _verify_resume_run,
    ),
    "trace": Command(
        "the exact plan: run the real model step on fake tensors and compare it with the analytic ledger",
        _trace_args,
        _trace_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainplan", description="Plan, run and verify LLM fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_args(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except TrainplanError as e:
        print(f"trainplan {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
