"""The `trainplan` command. Subcommands live in one table, COMMANDS."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainplan.errors import TrainplanError

EXIT_BAD_INPUT = 2
EXIT_GUARD_STOP = 3  # train: the stability guard stopped the run (a checkpoint of the last good state is kept)


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


# ---- advise -------------------------------------------------------------------------------


def _advise_args(p: argparse.ArgumentParser) -> None:
    from trainplan.advise.command import add_args

    add_args(p)


def _advise_run(args: argparse.Namespace) -> int:
    from trainplan.advise.command import run

    return run(args)


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
    p.add_argument(
        "--registry",
        default=None,
        help="run registry (SQLite) path; default $TRAINPLAN_REGISTRY or "
        "~/.cache/trainplan/runs.sqlite; 'off' records nothing",
    )


def _quiet_libraries() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def _train_run(args: argparse.Namespace) -> int:
    from trainplan.config import toml_literal
    from trainplan.run import dist, loop

    _quiet_libraries()
    if args.registry:
        os.environ["TRAINPLAN_REGISTRY"] = args.registry

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
        if record.get("stopped"):
            ev = record["stopped"]
            print(f"stopped by the stability guard at step {ev['step']}: {ev['key']} {ev['kind']} ({ev['value']:.4g})")
    if record.get("stopped"):
        return dist.finish(env, EXIT_GUARD_STOP)
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


# ---- accept ---------------------------------------------------------------------------------


def _accept_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--output-dir", default="runs/accept", help="where the run and the reports go")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="memory check: allowed |plan - measured|, as a fraction of each device's measured peak (default 0.05)",
    )
    p.add_argument("--resume-steps", type=int, default=4, help="resume check: N uninterrupted steps")
    p.add_argument("--resume-at", type=int, default=2, help="resume check: stop and checkpoint at k")
    p.add_argument("--overfit-steps", type=int, default=6, help="step check: steps on one fixed batch")
    p.add_argument("--nproc", type=int, default=1, help="ranks for the run (torchrun --standalone)")
    p.add_argument("--registry", default=None, help="run registry (SQLite) path; 'off' records nothing")
    p.add_argument(
        "--perturb-plan",
        action="append",
        default=[],
        metavar="COMPONENT=FACTOR",
        help="test hook: scale one plan component (e.g. activations=0.5) to see the memory check fail",
    )


def _accept_run(args: argparse.Namespace) -> int:
    from trainplan import accept, registry, report
    from trainplan.config import load

    _quiet_libraries()
    if args.registry:
        os.environ["TRAINPLAN_REGISTRY"] = args.registry
    perturb = {}
    for item in args.perturb_plan:
        comp, _, factor = item.partition("=")
        try:
            perturb[comp.strip()] = float(factor)
        except ValueError:
            raise TrainplanError(f"--perturb-plan: {item!r} is not COMPONENT=FACTOR; e.g. activations=0.5") from None
        from trainplan.plan.ledger import COMPONENTS

        if comp.strip() not in COMPONENTS:  # checked before any work starts
            raise TrainplanError(f"--perturb-plan: no plan component {comp.strip()!r}; one of {', '.join(COMPONENTS)}")
    if not 0 < args.tolerance < 1:
        raise TrainplanError(f"--tolerance: must be in (0, 1) (got {args.tolerance}); e.g. 0.05")
    if not 0 < args.resume_at < args.resume_steps:
        raise TrainplanError(f"--resume-at: must be between 1 and {args.resume_steps - 1}; choose k < N")
    if args.overfit_steps < 2:
        raise TrainplanError("--overfit-steps: needs at least 2 steps to see the loss fall; e.g. 6")
    defaults = [] if args.config else list(accept.DEFAULT_SETTINGS)
    cfg = load(args.config, [*defaults, *args.set], settings_from_args(args))
    out = Path(args.output_dir)
    result = accept.accept(
        cfg,
        out_dir=out,
        tolerance=args.tolerance,
        perturb=perturb,
        resume_steps=args.resume_steps,
        resume_at=args.resume_at,
        overfit_steps=args.overfit_steps,
        nproc=args.nproc,
    )
    rec = dict(result["record"], memory=result["memory"])
    try:
        row = registry.row_from_record(rec, kind="accept", verdict=result["verdict"], device=result["device_name"])
        result["registry_id"] = registry.add(row)
    except Exception as e:  # the acceptance ran; a registry that cannot be written is a warning
        print(f"trainplan accept: warning: run not registered ({type(e).__name__}: {e})", file=sys.stderr)
    write_atomic(out / "accept.json", json.dumps(result, indent=1, default=str))
    write_atomic(out / "accept.md", report.render_markdown(result))
    write_atomic(out / "accept.html", report.render_html(result))
    by_key = {c["key"]: c for c in result["checks"]}
    print(f"trainplan accept: {result['verdict']} ({result['seconds']:.0f} s)")
    for f in result["failing"]:
        print(f"  FAIL  {f}")
    for key in result["order"]:
        c = by_key[key]
        status = "n/a " if c["passed"] is None else ("ok  " if c["passed"] else "FAIL")
        print(f"  {status}  {c['name']}: {c['summary']}")
    print(f"reports: {out / 'accept.json'}, {out / 'accept.md'}, {out / 'accept.html'}")
    return 0 if result["verdict"] == "PASS" else 1


# ---- runs -----------------------------------------------------------------------------------


def _runs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "show", "compare"), help="list | show ID | compare A B")
    p.add_argument("ids", nargs="*", type=int, help="run ids (from `trainplan runs list`)")
    p.add_argument(
        "--registry", default=None, help="registry path (default $TRAINPLAN_REGISTRY or ~/.cache/trainplan/runs.sqlite)"
    )
    p.add_argument("--json", action="store_true")


def _runs_run(args: argparse.Namespace) -> int:
    from trainplan import registry

    db = registry.path(args.registry)
    want = {"list": 0, "show": 1, "compare": 2}[args.action]
    if len(args.ids) != want:
        raise TrainplanError(
            f"runs {args.action}: takes {want} run id(s), got {len(args.ids)}; `trainplan runs list` shows the ids"
        )
    if args.action == "list":
        items = registry.rows(db)
        print(json.dumps(items, indent=1) if args.json else registry.render_list(items))
    elif args.action == "show":
        item = registry.get(args.ids[0], db)
        print(json.dumps(item, indent=1) if args.json else registry.render_show(item))
    else:
        a, b = (registry.get(i, db) for i in args.ids)
        print(json.dumps([a, b], indent=1) if args.json else registry.render_compare(a, b))
    return 0


# ---- devices --------------------------------------------------------------------------------


def _devices_args(p: argparse.ArgumentParser) -> None:
    from trainplan.devices import add_args

    add_args(p)


def _devices_run(args: argparse.Namespace) -> int:
    from trainplan.devices import run

    return run(args)


COMMANDS: dict[str, Command] = {
    "plan": Command(
        "per-device memory ledger: will it fit, on each device, and why (exit 0 fits, 1 not, 2 bad input)",
        _plan_args,
        _plan_run,
    ),
    "advise": Command(
        "search the memory ladder for configurations that fit every device, ranked, with estimated step time",
        _advise_args,
        _advise_run,
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
    "accept": Command(
        "the acceptance run: mode contract, memory plan vs measured per device, step, quality, resume, "
        "instability; one verdict and JSON / Markdown / HTML reports",
        _accept_args,
        _accept_run,
    ),
    "runs": Command(
        "the run registry: list | show ID | compare A B",
        _runs_args,
        _runs_run,
    ),
    "trace": Command(
        "the exact plan: run the real model step on fake tensors and compare it with the analytic ledger",
        _trace_args,
        _trace_run,
    ),
    "devices": Command(
        "device preflight: inventory (memory, compute capability, bf16, driver, P2P) and health checks "
        "(determinism, matmul vs nominal, all-reduce); exit 0 passed, 1 a check failed, 2 bad input",
        _devices_args,
        _devices_run,
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
    # bitsandbytes' CPU backend warns when peft imports it, about an optional `kernels` package
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        return args._run(args)
    except TrainplanError as e:
        print(f"trainplan {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
