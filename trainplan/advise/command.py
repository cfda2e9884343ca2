"""`trainplan advise`: flags, ranking, the table / JSON, and the TOML file that `trainplan train` runs."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from trainplan import config as C
from trainplan.advise.estimate import StepEstimate, calibration_from_records, estimate, records_from_registry
from trainplan.advise.search import (
    MAX_DEVICES,
    NAMES,
    Outcome,
    Request,
    Search,
    base_ledger,
    layouts,
    peak_fraction,
    search,
    what_would_fit,
    why,
)
from trainplan.errors import ConfigError, nearest
from trainplan.plan.ledger import Ledger
from trainplan.resolve import NotRunnable, require_runnable, resolve
from trainplan.spec.devices import GiB
from trainplan.spec.model import load_model_spec

SCHEMA = "trainplan.advise/1"
MODE_CHOICES = ("auto", "full", "lora", "qlora", "inference")
PREFERENCES = ("ladder", "speed", "memory", "quality")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset name, HF model dir, config.json or .gguf")
    p.add_argument("--gpus", default="auto", help="devices, e.g. 8xH100-80GB, 1x24GiB, cpu (default: this machine's)")
    p.add_argument("--gpu-mem", default=None, help="override every GPU's capacity, e.g. 24GiB")
    p.add_argument("--seq", type=int, default=512, help="sequence length in tokens (default 512)")
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step (default: one per device)"
    )
    p.add_argument(
        "--mode", default="auto", help="auto (full, then LoRA, then QLoRA) | full | lora | qlora | inference"
    )
    p.add_argument("--prefer", default="ladder", help="ranking: ladder (default) | speed | memory | quality")
    p.add_argument("--margin", type=float, default=0.05, help="fraction of each device's capacity kept free (0.05)")
    p.add_argument("--top", type=int, default=10, help="entries to show (0: all that fit)")
    p.add_argument("--format", default="table", help="table | json")
    p.add_argument("--out", default=None, help="write the chosen configuration as TOML (atomically)")
    p.add_argument(
        "--registry",
        default=None,
        help="SQLite run registry: calibrate the MFU from measured runs "
        "(default: $TRAINPLAN_REGISTRY or ~/.cache/trainplan/runs.sqlite when it exists)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other config field, kept in --out"
    )


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(flag, f"unknown value {value!r}", nearest(value, choices))


def request_from_args(args: argparse.Namespace) -> Request:
    _choice("--mode", args.mode, MODE_CHOICES)
    _choice("--prefer", args.prefer, PREFERENCES)
    _choice("--format", args.format, ("table", "json"))
    if not 0 <= args.margin < 0.9:
        raise ConfigError("--margin", f"must be in [0, 0.9) (got {args.margin})", "e.g. --margin 0.05 keeps 5% free")
    if args.top < 0:
        raise ConfigError("--top", f"must be >= 0 (got {args.top})", "give a count, or 0 for every entry")
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model  # --out runs anywhere
    settings = {
        "model.source": model,
        "hardware.gpus": args.gpus,
        "batch.seq_len": args.seq,
        "hardware.safety_margin": args.margin,
    }
    if args.gpu_mem:
        settings["hardware.gpu_mem"] = args.gpu_mem
    base = C.load(None, args.set, settings)
    spec = load_model_spec(base.model.source)
    r = resolve(replace(base, mode="full", batch=C.BatchConfig(seq_len=base.batch.seq_len)), spec)  # refuses bad input
    world = len(r.devices)
    g = world if args.global_batch is None else args.global_batch
    if isinstance(g, bool) or g < 1:
        raise ConfigError("--global-batch", f"must be an integer >= 1 (got {g})", f"e.g. --global-batch {world}")
    modes = ("full", "lora", "qlora") if args.mode == "auto" else (args.mode,)
    if args.registry is None:  # the run registry that train and accept write, when there is one
        from trainplan import registry

        default = registry.path()
        args.registry = str(default) if registry.enabled() and default.is_file() else None
    calibration = calibration_from_records(records_from_registry(args.registry)) if args.registry else {}
    req = Request(base=base, spec=spec, modes=modes, global_batch=g, calibration=calibration)
    if not layouts(spec, r.devices, g)[0]:
        raise ConfigError(
            "--global-batch",
            f"{g} is not divisible by the data-parallel degree of any layout of {spec.name} on {world} devices",
            f"use a multiple of {world}",
        )
    return req


# ---- ranking ---------------------------------------------------------------------------------


def ranked(s: Search, prefer: str) -> list[Outcome]:
    """Configurations that fit, best first. The ladder order is the default; speed sorts by the
    estimated step time, memory by the fullest device at micro-batch 1, quality by the settings that
    change the result (mode, LoRA coverage and rank, precision, optimizer), then speed."""
    fitting = [o for o in s.outcomes if o.fits]  # ladder order

    def seconds(o: Outcome) -> float:
        return o.estimate.step_s if o.estimate and o.estimate.step_s else float("inf")

    if prefer == "speed":
        return sorted(fitting, key=seconds)
    if prefer == "memory":
        return sorted(fitting, key=lambda o: peak_fraction(base_ledger(s, o)))
    if prefer == "quality":
        return sorted(fitting, key=lambda o: (o.rung.key[:5], seconds(o)))
    return fitting


def shown(s: Search, o: Outcome, prefer: str) -> tuple[int, Ledger, StepEstimate | None]:
    """(micro-batch, ledger, estimate) an entry is shown with: memory preference keeps micro-batch 1."""
    if prefer != "memory" or o.best_micro == 1:
        return o.best_micro, o.best, o.estimate
    cfg = o.rung.config(s.request.base, 1, s.request.global_batch)
    return 1, base_ledger(s, o), estimate(resolve(cfg, s.request.spec), s.request.calibration)


def train_blocker(s: Search, o: Outcome) -> str:
    """What `trainplan train` would refuse in this entry, in a few words ('' if it runs it): the one
    rule `train` applies itself (trainplan/resolve.py `require_runnable`)."""
    cfg = o.rung.config(s.request.base, 1, s.request.global_batch)
    shards = o.rung.dp > 1 and o.rung.strategy in ("zero3", "fsdp-grad-op")
    try:
        require_runnable(
            cfg,
            max_positions=s.request.spec.max_position_embeddings,
            sharded=shards,
            cuda=all(d.is_gpu for d in s.devices),
        )
    except NotRunnable as e:
        return e.what
    return ""


# ---- output ----------------------------------------------------------------------------------


def _devices_text(s: Search) -> str:
    names = [d.name for d in s.devices]
    if len(set(names)) == 1:
        return f"{len(names)} x {names[0]}"
    return ", ".join(names)


def mfu_text(s: Search, registry: str | None) -> str:
    est = next((o.estimate for o in s.outcomes if o.estimate), None)
    if est is None:
        return "step time is an estimate (no fitting configuration to estimate)"
    parts = [f"{est.mfu[n] * 100:.1f}% on {n}, {est.mfu_source[n]}" for n in est.mfu]
    source = ""
    if registry and all(v == "assumed" for v in est.mfu_source.values()):
        source = f"; no usable runs for these devices in {registry}"
    elif registry:
        source = f"; calibrated from the runs in {registry}"
    if est.step_s is None:
        source += "; n/a: the catalog has no peak TFLOP/s or link bandwidth for a generic GPU (name the card)"
    return f"step time is an estimate (MFU {'; '.join(parts)}{source}): see docs/advise.md"


def entry_json(s: Search, o: Outcome, rank: int, prefer: str) -> dict:
    m, ledger, est = shown(s, o, prefer)
    r = o.rung
    worst = max(ledger.all_ledgers, key=lambda d: d.total_bytes / d.usable_bytes)
    return {
        "rank": rank,
        "mode": r.mode,
        "precision": r.precision,
        "strategy": r.strategy if r.dp > 1 else "single",
        "tp": r.tp,
        "pp": r.pp,
        "dp": r.dp,
        "micro_batch_size": m,
        "grad_accum_steps": ledger.settings["grad_accum_steps"],
        "activation_checkpointing": r.ac,
        "optimizer": r.optimizer,
        "lora": {"r": r.lora_r, "targets": r.targets_label, "target_modules": list(r.lora_targets)}
        if r.lora_r
        else None,
        "summary": ledger.settings["summary"],
        "peak": {
            "device": worst.label,
            "total_bytes": worst.total_bytes,
            "usable_bytes": worst.usable_bytes,
            "fraction": worst.total_bytes / worst.usable_bytes,
        },
        "devices": [
            {
                "label": d.label,
                "device": d.device.name,
                "total_bytes": d.total_bytes,
                "usable_bytes": d.usable_bytes,
                "headroom_bytes": d.headroom_bytes,
                "largest_component": d.largest_component,
            }
            for d in ledger.all_ledgers
        ],
        "estimate": None
        if est is None
        else {
            "step_seconds": est.step_s,
            "tokens_per_s": est.tokens_per_s,
            "compute_seconds": est.compute_s,
            "data_parallel_comm_seconds": est.data_parallel_comm_s,
            "tensor_parallel_comm_seconds": est.tensor_parallel_comm_s,
            "pipeline_seconds": est.pipeline_s,
            "flops_per_token": est.flops_per_token,
            "mfu": est.mfu,
            "mfu_source": est.mfu_source,
        },
        "why": why(o, s, show_micro=prefer != "memory"),
        "train_refuses": train_blocker(s, o) or None,
    }


def _seconds(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def render_table(entries: list[dict], total_fit: int) -> list[str]:
    head = ["#", "mode", "precision", "strategy", "tp/pp", "micro x accum", "AC", "optimizer", "lora"]
    head += ["peak / usable (GiB)", "step (est.)", "tokens/s (est.)", "why"]
    rows = [head]
    for e in entries:
        est = e["estimate"] or {}
        tps = est.get("tokens_per_s")
        rows.append(
            [
                str(e["rank"]),
                e["mode"],
                e["precision"],
                NAMES.get(e["strategy"], e["strategy"]),
                f"{e['tp']}/{e['pp']}",
                f"{e['micro_batch_size']} x {e['grad_accum_steps']}",
                "on" if e["activation_checkpointing"] else "off",
                "-" if e["mode"] == "inference" else NAMES[e["optimizer"]],
                f"r{e['lora']['r']} {e['lora']['targets']}" if e["lora"] else "-",
                f"{e['peak']['total_bytes'] / GiB:.1f} / {e['peak']['usable_bytes'] / GiB:.1f} ({e['peak']['device']})",
                _seconds(est.get("step_seconds")),
                f"{tps:,.0f}" if tps else "n/a",
                e["why"],
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * min(160, max(len(x) for x in lines)))
    if total_fit > len(entries):
        lines.append(f"... and {total_fit - len(entries)} more that fit (--top 0 shows all)")
    return lines


def launch_command(world: int, path: str) -> str:
    return f"torchrun --nproc_per_node {world} -m trainplan train {path}" if world > 1 else f"trainplan train {path}"


def out_toml(s: Search, o: Outcome, rank: int, prefer: str, path: str) -> str:
    m, _, _ = shown(s, o, prefer)
    cfg = o.rung.config(s.request.base, m, s.request.global_batch)
    launch = launch_command(len(s.devices), path)
    header = [
        f"# trainplan advise: {s.request.spec.name} on {_devices_text(s)}, rank {rank} (prefer {prefer})",
        f"# {o.rung.short()}; micro-batch {m}, global batch {s.request.global_batch}",
        f"# why: {why(o, s, show_micro=prefer != 'memory')}",
        f"# run: {launch}",
    ]
    return "\n".join(header) + "\n" + C.to_toml(cfg)


def run(args: argparse.Namespace) -> int:
    from trainplan.cli import write_atomic

    req = request_from_args(args)
    s = search(req)
    order = ranked(s, args.prefer)
    top = order if args.top == 0 else order[: args.top]
    entries = [entry_json(s, o, i + 1, args.prefer) for i, o in enumerate(top)]
    doc = {
        "schema": SCHEMA,
        "model": req.spec.summary(),
        "devices": _devices_text(s),
        "request": {
            "mode": args.mode,
            "prefer": args.prefer,
            "seq_len": req.base.batch.seq_len,
            "global_batch_size": req.global_batch,
            "margin": args.margin,
        },
        "rungs": len(s.outcomes),
        "fit": len(order),
        "evaluated": s.evaluated,
        "seconds": s.seconds,
        "entries": entries,
        "estimate_note": mfu_text(s, args.registry),
        "skipped_layouts": s.skipped_layouts,
        "nothing_fits": None,
        "out": None,
    }
    notes = []
    if not order:
        reason, options, spent = what_would_fit(s)
        doc["nothing_fits"] = {"reason": reason, "needs": options, "evaluated": spent}
        if args.out:
            notes.append(f"nothing fits: {args.out} not written")
    elif args.out:
        chosen = next((i for i, o in enumerate(order) if not train_blocker(s, o)), 0)
        write_atomic(args.out, out_toml(s, order[chosen], chosen + 1, args.prefer, args.out))
        doc["out"] = {"path": str(Path(args.out)), "rank": chosen + 1}
        blocker = train_blocker(s, order[0])
        if chosen:
            notes.append(f"wrote rank {chosen + 1}: `trainplan train` does not run {blocker} yet")
        elif blocker:
            notes.append(f"every entry needs something `trainplan train` does not run yet: {blocker}")
    doc["notes"] = notes
    if args.format == "json":
        print(json.dumps(doc, indent=1))
    else:
        print(render_text(s, doc, args))
    return 0 if order else 1


def render_text(s: Search, doc: dict, args: argparse.Namespace) -> str:
    req = s.request
    out = [
        f"trainplan advise — {req.spec.name} ({req.spec.num_params / 1e6:,.1f}M params) on {doc['devices']}, "
        f"seq {req.base.batch.seq_len}, global batch {req.global_batch}, mode {args.mode}, prefer {args.prefer}",
        f"searched {doc['rungs']} rungs: {doc['evaluated']:,} candidate configurations planned in "
        f"{doc['seconds']:.2f} s; {doc['fit']} fit every device with a {args.margin:.0%} margin",
        "",
    ]
    if doc["fit"]:
        out += render_table(doc["entries"], doc["fit"]) + ["", doc["estimate_note"]]
    else:
        nf = doc["nothing_fits"]
        out.append("NOTHING FITS: " + nf["reason"])
        out.append("needs " + (", or ".join(nf["needs"]) if nf["needs"] else f"more than {MAX_DEVICES} devices"))
    out += ["note: " + n for n in doc["notes"]]
    if doc["out"]:
        out.append(f"wrote {args.out} (rank {doc['out']['rank']}); run it: {launch_command(len(s.devices), args.out)}")
    return "\n".join(out)
