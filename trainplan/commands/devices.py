"""`trainplan devices`: the device preflight's inventory and health checks (verify/preflight.py)."""

from __future__ import annotations

import argparse
import json
import sys

from trainplan.commands._common import emit, output_file
from trainplan.errors import TrainplanError
from trainplan.spec.devices import format_gib
from trainplan.text import ascii_int
from trainplan.verify.preflight import (
    CPU_MATMUL_SIZE,
    GPU_MATMUL_SIZE,
    MIN_MATMUL_RATIO,
    DeviceInfo,
    Inventory,
)

HELP = (
    "device preflight: inventory (memory, compute capability, bf16, driver, P2P) and health checks "
    "(determinism, matmul vs nominal, all-reduce); exit 0 passed, 1 a check failed, 2 bad input"
)


# ---- the command ----------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON (schema trainplan.devices/1)")
    p.add_argument("--output", "-o", type=output_file, help="write to this file (atomically) instead of stdout")
    p.add_argument("--gpus", default=None, help="GPU indices to check, e.g. 0,1 (default: every GPU)")
    p.add_argument("--skip-health", action="store_true", help="inventory only: run no health check")
    p.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help=f"matmul check size n (n^3 product; default {GPU_MATMUL_SIZE} on GPUs, {CPU_MATMUL_SIZE} on the CPU)",
    )
    p.add_argument("--matmul-reps", type=int, default=5, help="timed products per device (median reported)")
    p.add_argument(
        "--min-matmul-ratio",
        type=float,
        default=MIN_MATMUL_RATIO,
        help="GPU matmul check passes at this fraction of the catalog's nominal TFLOP/s",
    )
    p.add_argument(
        "--allreduce-cpu", action="store_true", help="also run the all-reduce check with 2 gloo CPU processes"
    )
    p.add_argument("--allreduce-mib", type=float, default=None, help="all-reduce size (default 256 MiB GPU, 8 MiB CPU)")


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse bad numeric flags before anything is imported or run (TrainplanError: exit 2)."""
    if args.matmul_size is not None and not 64 <= args.matmul_size <= 32768:
        raise TrainplanError(f"--matmul-size: must be between 64 and 32768 (got {args.matmul_size}); e.g. 8192")
    if not 1 <= args.matmul_reps <= 1000:
        raise TrainplanError(f"--matmul-reps: must be between 1 and 1000 (got {args.matmul_reps}); e.g. 5")
    if not 0 < args.min_matmul_ratio <= 1:
        raise TrainplanError(f"--min-matmul-ratio: must be in (0, 1] (got {args.min_matmul_ratio:g}); e.g. 0.5")
    if args.allreduce_mib is not None and not 0 < args.allreduce_mib <= 16384:
        raise TrainplanError(f"--allreduce-mib: must be in (0, 16384] (got {args.allreduce_mib:g}); e.g. 256")
    if args.gpus is not None:
        _indices(args.gpus)


def _indices(text: str) -> list[int]:
    try:
        return [ascii_int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise TrainplanError(f"--gpus: {text!r} is not a list of GPU indices; write e.g. 0,1") from None


def _targets(args: argparse.Namespace, inv: Inventory) -> list[DeviceInfo]:
    """The devices to check: --gpus, else every GPU, else the CPU."""
    if args.gpus is None:
        return inv.gpus or inv.devices
    wanted = _indices(args.gpus)
    n = len(inv.gpus)
    missing = [i for i in wanted if not 0 <= i < n]
    if missing or not wanted:
        raise TrainplanError(
            f"--gpus: GPU {missing[0] if missing else args.gpus!r} is not present; "
            f"this machine has {n} CUDA GPU(s){' (indices 0-' + str(n - 1) + ')' if n else ''}"
        )
    return [inv.gpus[i] for i in wanted]


def render_table(doc: dict) -> str:
    inv = doc["inventory"]
    head = ("device", "name", "capacity", "free", "compute", "cores", "bf16")
    rows = [
        (
            d["label"],
            d["name"],
            format_gib(d["capacity_bytes"], 1),
            format_gib(d["free_bytes"], 1),
            d["compute"],
            str(d["cores"] or "-"),
            d["bf16_detail"],
        )
        for d in inv["devices"]
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]]
    v = inv["versions"]
    lines.append(
        f"python {v['python']}, torch {v['torch']}, CUDA {v['cuda']}, driver {v['driver']}"
        + (f" (CUDA driver API {v['cuda_driver']})" if "cuda_driver" in v else "")
        + f"; NVML: {inv['nvml']}"
    )
    for d in inv["devices"]:
        if d["nvml"]:
            lines.append(f"{d['label']} NVML: " + ", ".join(f"{k} {v}" for k, v in d["nvml"].items()))
    if inv["p2p"]:
        lines.append(
            "P2P: " + ", ".join(f"{p['from']}->{p['to']} {'yes' if p['access'] else 'no'}" for p in inv["p2p"])
        )
    lines += inv["notes"]
    if doc["checks"]:
        lines += ["", "Health checks:"]
        status = {True: "ok  ", False: "FAIL", None: "info"}
        lines += [f"  {status[c['passed']]}  {c['name']}: {c['summary']}" for c in doc["checks"]]
    if doc["not_checked"]:
        lines += ["", "Not checked:", *(f"  - {x}" for x in doc["not_checked"])]
    verdict = "PASS: every check that ran passed" if doc["passed"] else f"FAIL: {', '.join(doc['failed'])}"
    return "\n".join([*lines, "", verdict])


def run(args: argparse.Namespace) -> int:
    from trainplan.verify.preflight import health_checks, inventory, report

    _check_numbers(args)
    inv = inventory()
    targets = _targets(args, inv)
    if sys.stderr.isatty():  # a health check can take seconds: say what is running
        print(f"trainplan devices: checking {', '.join(d.label for d in targets)} ...", file=sys.stderr)
    import transformers

    transformers.logging.set_verbosity_error()
    checks, not_checked = health_checks(inv, targets, args)
    doc = report(inv, checks, not_checked)
    emit(args, json.dumps(doc, indent=1) if args.json else render_table(doc))
    return 0 if doc["passed"] else 1
