"""`trainplan accept`: the acceptance run and its reports."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from trainplan.commands._common import (
    add_config_args,
    add_logging_args,
    add_registry_arg,
    check_fraction,
    check_nproc,
    output_dir,
    settings_from_args,
    setup_logging,
    split_positional,
    warn,
)
from trainplan.errors import TrainplanError
from trainplan.files import require_writable, write_atomic
from trainplan.text import ascii_float

HELP = (
    "the acceptance run: mode contract, memory plan vs measured per device, step, quality, resume, "
    "instability; one verdict and JSON / Markdown / HTML reports"
)


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--output-dir", default="runs/accept", type=output_dir, help="where the run and the reports go")
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
    add_registry_arg(p)
    add_logging_args(p)
    p.add_argument(
        "--perturb-plan",
        action="append",
        default=[],
        metavar="COMPONENT=FACTOR",
        help="test hook: scale one plan component (e.g. activations=0.5) to see the memory check fail",
    )


MAX_PERTURB = 1000.0  # a test hook's scale: halving or doubling a component, never a thousandfold


def refuse_plan_only(cfg, nproc: int):
    """A layout `trainplan train` does not run is refused before anything loads, with plan's reason.
    Checked on the devices the run will have, as train names them (run/record.py `device_label`);
    returns cfg on those devices (a tp layout divides the --nproc ranks, not the one device of "auto")."""
    import dataclasses

    from trainplan.plan.analytic import choose_checkpointing, runnable
    from trainplan.resolve import resolve
    from trainplan.spec.devices import GiB, parse_devices

    if cfg.hardware.gpus in ("auto", "", "cpu"):
        first = parse_devices(cfg.hardware.gpus or "auto", cfg.hardware.gpu_mem)[0]
        one = f"{first.capacity_bytes / GiB:.0f}GiB" if first.is_gpu else "cpu"
        gpus = one if nproc == 1 else f"{nproc}x{one}"
        cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, gpus=gpus))
    verdict = runnable(resolve(choose_checkpointing(cfg)[0]))
    if not verdict["ok"]:
        raise TrainplanError(f"accept: plan only, `trainplan train` does not run this layout: {verdict['why']}")
    return cfg


def run(args: argparse.Namespace) -> int:
    from trainplan.config import load
    from trainplan.run.progress import Progress, duration
    from trainplan.run.record import RunRecord
    from trainplan.verify import accept, registry

    setup_logging(args)
    perturb = {}
    for item in args.perturb_plan:
        comp, _, factor = item.partition("=")
        try:
            perturb[comp.strip()] = ascii_float(factor)
        except ValueError:
            raise TrainplanError(f"--perturb-plan: {item!r} is not COMPONENT=FACTOR; e.g. activations=0.5") from None
        f = perturb[comp.strip()]
        if not (math.isfinite(f) and 0 < f <= MAX_PERTURB):  # a byte count scaled by NaN, inf or < 0 is no plan
            raise TrainplanError(
                f"--perturb-plan: factor {factor.strip()!r} of {comp.strip()!r} must be a number above 0 and at most "
                f"{MAX_PERTURB:g}; e.g. activations=0.5"
            )
        from trainplan.plan.ledger import COMPONENTS

        if comp.strip() not in COMPONENTS:  # checked before any work starts
            raise TrainplanError(f"--perturb-plan: no plan component {comp.strip()!r}; one of {', '.join(COMPONENTS)}")
    check_fraction("--tolerance", args.tolerance)
    check_nproc(args.nproc)
    if args.resume_steps < 2:
        raise TrainplanError(f"--resume-steps: must be >= 2 (got {args.resume_steps}); e.g. --resume-steps 4")
    if not 0 < args.resume_at < args.resume_steps:
        raise TrainplanError(f"--resume-at: must be between 1 and {args.resume_steps - 1}; choose k < N")
    if args.overfit_steps < 2:
        raise TrainplanError("--overfit-steps: needs at least 2 steps to see the loss fall; e.g. 6")
    # the shipped demo config unless one is given; flags and --set override either
    split_positional(args)
    cfg = load(args.config or accept.DEFAULT_CONFIG, args.set, settings_from_args(args))
    cfg = refuse_plan_only(cfg, args.nproc)  # before any model is loaded
    out = Path(args.output_dir)
    require_writable(out, "--output-dir")  # before any run: the reports must have somewhere to go
    with Progress() as progress:
        result = accept.accept(
            cfg,
            out_dir=out,
            tolerance=args.tolerance,
            perturb=perturb,
            resume_steps=args.resume_steps,
            resume_at=args.resume_at,
            overfit_steps=args.overfit_steps,
            nproc=args.nproc,
            progress=progress,
        )
    rec = RunRecord.from_json(dict(result["record"], memory=result["memory"]))
    try:
        row = registry.row_from_record(rec, kind="accept", verdict=result["verdict"], device=result["device_name"])
        result["registry_id"] = registry.add(row, registry.path(args.registry))
    except Exception as e:  # the acceptance ran; a registry that cannot be written is a warning
        warn("accept", f"run not registered ({type(e).__name__}: {e})")
    write_atomic(out / "accept.json", json.dumps(result, indent=1, default=str))
    from trainplan.verify import report  # matplotlib: loaded once there is a result to draw

    write_atomic(out / "accept.md", report.render_markdown(result))
    write_atomic(out / "accept.html", report.render_html(result))
    by_key = {c["key"]: c for c in result["checks"]}
    print(f"trainplan accept: {result['verdict']}; {report.RUN_TIME} {report.run_wall_time(result)}")
    for f in result["failing"]:
        print(f"  FAIL  {f}")
    for key in result["order"]:
        c = by_key[key]
        status = "n/a " if c["passed"] is None else ("ok  " if c["passed"] else "FAIL")
        print(f"  {status}  {c['name']}: {c['summary']} ({duration(c['seconds'])})")
    print(f"reports: {out / 'accept.json'}, {out / 'accept.md'}, {out / 'accept.html'}")
    return 0 if result["verdict"] == "PASS" else 1
