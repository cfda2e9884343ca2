"""`trainplan launch`: the launch file for a planned layout on torchrun, SLURM, SkyPilot or
Kubeflow Trainer, refused when the plan says it does not fit. Imports no torch."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from trainplan.commands._common import CONFIG_FLAGS, SWITCHES, add_config_args, config_from_args, emit, output_file
from trainplan.errors import ConfigError

HELP = "write a multi-node launch file (torchrun, slurm, skypilot, trainjob) for a plan that fits (exit 1: it does not)"


def add_args(p: argparse.ArgumentParser) -> None:
    from trainplan.run.launchers import TARGETS

    add_config_args(p)
    p.add_argument("--target", required=True, choices=TARGETS, help="the scheduler the file is for")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: world size / gpus-per-node)")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help="ranks per node (default: 8 where 8 divides the world size)"
    )
    p.add_argument("--port", type=int, default=None, help="rendezvous port on the first node (default 29500)")
    p.add_argument("--name", default=None, help="job name (default: trainplan-<config name>)")
    p.add_argument("--image", default=None, help="container image with trainplan installed (trainjob)")
    p.add_argument("--output", "-o", type=output_file, help="write to this file (atomically) instead of stdout")


def run(args: argparse.Namespace) -> int:
    from trainplan.plan.analytic import plan
    from trainplan.run import launchers

    cfg = config_from_args(args)
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ConfigError("--port", f"must be between 1 and 65535 (got {args.port})", "e.g. --port 29500")
    if cfg.hardware.gpus.strip().lower() in ("auto", ""):
        raise ConfigError(
            "hardware.gpus",
            "is 'auto' (this machine's devices), but a launch file is planned for the cluster's",
            "name the job's devices, e.g. --gpus 16xH100-80GB",
        )
    if not (cfg.train.output_dir or cfg.checkpoint.dir):
        raise ConfigError(
            "train.output_dir",
            "is not set: each start would pick a new directory, so a restarted job could not find its checkpoints",
            "set it to a directory every node shares, e.g. --set train.output_dir=/shared/runs/llama8b",
        )
    ledger = plan(cfg)
    if ledger.exit_code:
        print(f"trainplan launch: {ledger.verdict()}; nothing written", file=sys.stderr)
        return ledger.exit_code
    if ledger.state != "FITS":
        print(f"trainplan launch: warning: {ledger.verdict()}", file=sys.stderr)
    world_size = len(ledger.devices)
    nodes, per_node = launchers.split_nodes(world_size, args.nodes, args.gpus_per_node, cfg.hardware.gpus)
    given = train_args(args)
    kinds = {d.device.kind for d in ledger.devices}
    if args.name:
        launchers.one_line("--name", args.name)  # before job_name() turns it into a slug
    name = args.name or f"trainplan-{Path(args.config).stem if args.config else 'job'}"
    layout = launchers.Layout(
        nodes=nodes,
        ranks_per_node=per_node,
        devices=tuple(d.device.name for d in ledger.devices),
        kind="cpu" if kinds == {"cpu"} else sorted(kinds - {"cpu"})[0],
        name=launchers.job_name(name),
        train_args=(*given, "--set", "checkpoint.resume=auto"),
        header=header(ledger, args.target, nodes, per_node, given),
        image=args.image,
        port=launchers.RDZV_PORT if args.port is None else args.port,
        checkpoint_dir=cfg.checkpoint.dir or cfg.train.output_dir,
    )
    emit(args, launchers.render(args.target, layout).rstrip("\n"))
    return 0


def train_args(args: argparse.Namespace) -> list[str]:
    """The config and every config flag given to `launch`, for `trainplan train` on each rank: the
    run then plans exactly what was planned here."""
    out = [args.config] if args.config else []
    for flag, _, _ in CONFIG_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    for flag, _, _ in SWITCHES:
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            out.append(flag)
    if args.lora_targets is not None:
        out += ["--lora-targets", args.lora_targets]
    for item in args.set:
        out += ["--set", item]
    return out


def header(ledger, target: str, nodes: int, per_node: int, plan_args: list[str]) -> tuple[str, ...]:
    """The comment lines every launch file starts with: the verdict and each device kind's peak."""
    from trainplan.plan.ledger import gib

    lines = [
        f"trainplan launch --target {target}: {nodes} node(s) x {per_node} rank(s) = world {nodes * per_node}",
        f"plan ({ledger.source}): {ledger.verdict()}",
    ]
    seen: dict[str, object] = {}
    for d in ledger.all_ledgers:
        key = "host" if d is ledger.host else d.device.name
        if key not in seen or d.total_bytes > seen[key].total_bytes:
            seen[key] = d
    for key, d in seen.items():
        lines.append(
            f"planned peak on {key}: {gib(d.total_bytes)} of {gib(d.usable_bytes)} usable "
            f"(at {d.peak_phase}, headroom {gib(d.headroom_bytes)})"
        )
    lines.append("the whole ledger: " + shlex.join(["trainplan", "plan", *plan_args]))
    return tuple(lines)
