"""`trainplan advise`: flags, ranking, the table / JSON, and the TOML file that `trainplan train` runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainplan import config as C
from trainplan.advise.estimate import StepEstimate, estimate
from trainplan.advise.search import (
    MAX_DEVICES,
    NAMES,
    Outcome,
    Rung,
    Search,
    base_ledger,
    peak_fraction,
    why,
)
from trainplan.plan.ledger import Ledger
from trainplan.resolve import NotRunnable, model_facts, require_runnable, resolve
from trainplan.spec.devices import DeviceSpec, GiB
from trainplan.spec.model import ModelSpec
from trainplan.spec.parallel import PARAM_SHARDING_STRATEGIES, ParallelDims

SCHEMA = "trainplan.advise/1"


def fit_margin(margin: float) -> str:
    """How a row's fit was judged: the verdict's own margin, and any further fraction kept free."""
    extra = f" and {margin:.0%} of capacity kept free (--margin)" if margin else ""
    return f" (the verdict's margin: accuracy band + allocator reserve{extra})"


def ranked(s: Search, prefer: str, *, include_unrunnable: bool = False) -> list[Outcome]:
    """Configurations that fit, best first: those `trainplan train` runs, then the plan-only ones (each
    shown with what train refuses), unless include_unrunnable ranks every one by the preference alone.
    The ladder order is the default; speed sorts by the estimated step time, memory by the fullest
    device at micro-batch 1, quality by the settings that change the result (mode, LoRA coverage and
    rank, precision, optimizer), then speed."""
    order = _by_preference(s, prefer)
    if include_unrunnable:
        return order
    return sorted(order, key=lambda o: bool(train_blocker(s, o)))  # stable: each group keeps its order


def _by_preference(s: Search, prefer: str) -> list[Outcome]:
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
    return rung_blocker(cfg, o.rung, s.request.spec, s.devices)


def rung_blocker(cfg: C.RunConfig, r: Rung, spec: ModelSpec, devices: list[DeviceSpec]) -> str:
    """train_blocker for a rung's config as it will be written."""
    strategy = r.strategy if r.dp > 1 or r.strategy in PARAM_SHARDING_STRATEGIES else "single"  # FSDP2 on one rank
    dims = ParallelDims(world_size=r.dp * r.tp * r.pp, dp=r.dp, tp=r.tp, pp=r.pp, strategy=strategy, cp=r.cp)
    try:
        require_runnable(cfg, dims, cuda=all(d.is_gpu for d in devices), **model_facts(spec))
    except NotRunnable as e:
        return e.what
    return ""


# ---- output ----------------------------------------------------------------------------------


def devices_text(s: Search) -> str:
    names = [d.name for d in s.devices]
    if len(set(names)) == 1:
        return f"{len(names)} x {names[0]}"
    return ", ".join(names)


def mfu_text(s: Search, registry: str | None) -> str:
    return estimate_note(next((o.estimate for o in s.outcomes if o.estimate), None), registry)


def estimate_note(est: StepEstimate | None, registry: str | None) -> str:
    """What the step-time estimate assumed (the MFU and where it came from), for one estimate."""
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


def rung_json(r: Rung) -> dict:
    """A rung's settings, as both advise outputs list them."""
    return (
        {
            "mode": r.mode,
            "precision": r.precision,
            "strategy": r.strategy if r.dp > 1 else "single",
            "tp": r.tp,
            "pp": r.pp,
            "dp": r.dp,
        }
        | ({"cp": r.cp} if r.cp > 1 else {})
        | ({"tiled_mlp": True} if r.tiled else {})
        | ({"offload_checkpoints": True} if r.offload_checkpoints else {})
        | ({"optimizer_on_host": True} if r.host_optimizer else {})
    )


def peak_json(ledger: Ledger) -> dict:
    """The fullest device of a ledger: its bill against its usable capacity."""
    worst = max(ledger.all_ledgers, key=lambda d: d.total_bytes / d.usable_bytes)
    return {
        "device": worst.label,
        "total_bytes": worst.total_bytes,
        "usable_bytes": worst.usable_bytes,
        "fraction": worst.total_bytes / worst.usable_bytes,
    }


def entry_json(s: Search, o: Outcome, rank: int, prefer: str) -> dict:
    m, ledger, est = shown(s, o, prefer)
    r = o.rung
    return {
        "rank": rank,
        **rung_json(r),
        "micro_batch_size": m,
        "grad_accum_steps": ledger.settings["grad_accum_steps"],
        "activation_checkpointing": r.ac,
        "optimizer": r.optimizer,
        "lora": {"r": r.lora_r, "targets": r.targets_label, "target_modules": list(r.lora_targets)}
        if r.lora_r
        else None,
        "summary": ledger.settings["summary"],
        "peak": peak_json(ledger),
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


def _run_time(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x < 60:
        return f"{x:.1f} s"
    if x < 3600:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.1f} h" if x < 86400 * 2 else f"{x / 86400:.1f} d"


def render_table(entries: list[dict], total_fit: int, *, terminal: bool = False) -> str:
    """The ranked entries as a table, then why each one is what it is (wrapped, never cut)."""
    from trainplan.text import columns, render, table, wrap

    timed = any(e.get("run") for e in entries)  # --tokens / --epochs: the run's time, and with a price its cost
    priced = any((e.get("run") or {}).get("cost") is not None for e in entries)
    extra = ["run\n(est.)>"] * timed + ["cost\n(est.)>"] * priced
    t = table(
        "#>",
        "mode",
        "layout",
        "batch",
        "AC / optimizer",
        "LoRA",
        "peak / usable\n(GiB)",
        "step\n(est.)>",
        "tokens/s\n(est.)>",
        *extra,
        show_lines=True,
    )
    for e in entries:
        est = e["estimate"] or {}
        tps = est.get("tokens_per_s")
        run = e.get("run") or {}
        cells = [_run_time(run.get("seconds"))] * timed
        cells += [
            f"{run['cost']:,.2f}\n{run['device_hours']:,.2f} dev-h" if run.get("cost") is not None else "n/a"
        ] * priced
        t.add_row(
            str(e["rank"]),
            f"{e['mode']}\n{e['precision']}",
            f"{NAMES.get(e['strategy'], e['strategy'])}\ntp {e['tp']}, pp {e['pp']}",
            f"micro {e['micro_batch_size']}\naccum {e['grad_accum_steps']}",
            f"AC {'on' if e['activation_checkpointing'] else 'off'}\n"
            + ("-" if e["mode"] == "inference" else NAMES[e["optimizer"]]),
            f"r{e['lora']['r']}\n{e['lora']['targets']}" if e["lora"] else "-",
            f"{e['peak']['total_bytes'] / GiB:.1f} / {e['peak']['usable_bytes'] / GiB:.1f}\n{e['peak']['device']}",
            _seconds(est.get("step_seconds")),
            f"{tps:,.0f}" if tps else "n/a",
            *cells,
        )
    width = columns(terminal)
    lines = [render(t, terminal=terminal)]
    if total_fit > len(entries):
        lines.append(f"... and {total_fit - len(entries)} more that fit (--top 0 shows all)")
    lines += ["", "why:"] + [wrap(f"{e['rank']:>2}  {e['why']}", indent="  ", width=width) for e in entries]
    return "\n".join(lines)


def launch_command(world: int, path: str) -> str:
    return f"torchrun --nproc_per_node {world} -m trainplan train {path}" if world > 1 else f"trainplan train {path}"


def out_toml(s: Search, o: Outcome, row: int, of: int, prefer: str, path: str) -> str:
    """The TOML `--out` writes: row `row` of the `of` rows advise lists, with how it was chosen."""
    m, _, _ = shown(s, o, prefer)
    cfg = o.rung.config(s.request.base, m, s.request.global_batch)
    launch = launch_command(len(s.devices), path)
    header = [
        f"# trainplan advise: {s.request.spec.name} on {devices_text(s)}: row {row} of {of} (prefer {prefer})",
        f"# {o.rung.short()}; micro-batch {m}, global batch {s.request.global_batch}",
        f"# why: {why(o, s, show_micro=prefer != 'memory')}",
        f"# run: {launch}",
    ]
    return "\n".join(header + weights_note(cfg)) + "\n" + C.to_toml(cfg)


def weights_note(cfg: C.RunConfig) -> list[str]:
    """A comment line for a written config whose model is an architecture without weights."""
    source = cfg.model.source
    if cfg.model.init != "random" and not (source == "default" or source.endswith(".gguf") or Path(source).is_dir()):
        return [
            f"# before training: {source!r} names an architecture, not weights; set model.source to a local "
            "directory holding them (`trainplan train` refuses to start from random weights)"
        ]
    return []


def render_text(s: Search, doc: dict, args: argparse.Namespace, *, terminal: bool = False) -> str:
    from trainplan.text import columns, wrap

    req = s.request
    width = columns(terminal)
    out = [
        wrap(
            f"trainplan advise — {req.spec.name} ({req.spec.num_params / 1e6:,.1f}M params) on {doc['devices']}, "
            f"seq {req.base.batch.seq_len}, global batch {req.global_batch}, mode {args.mode}, prefer {args.prefer}",
            width=width,
        ),
        wrap(
            f"searched {doc['rungs']} rungs: {doc['evaluated']:,} candidate configurations planned in "
            f"{doc['seconds']:.2f} s; {doc['fit']} FIT every device{fit_margin(args.margin)}",
            width=width,
        ),
        "",
    ]
    paragraphs = []
    if doc["fit"]:
        out += [render_table(doc["entries"], doc["fit"], terminal=terminal), ""]
        paragraphs.append(doc["estimate_note"])
    else:
        nf = doc["nothing_fits"]
        paragraphs.append("NOTHING FITS: " + nf["reason"])
        paragraphs.append("needs " + (", or ".join(nf["needs"]) if nf["needs"] else f"more than {MAX_DEVICES} devices"))
    paragraphs += ["note: " + n for n in doc["notes"]]
    if doc["out"]:
        paragraphs.append(
            f"wrote {args.out} (row 1 of {doc['out']['of']}); run it: {launch_command(len(s.devices), args.out)}"
        )
    out += [wrap(p, width=width) for p in paragraphs]
    return "\n".join(out)
