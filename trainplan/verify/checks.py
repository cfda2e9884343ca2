"""The acceptance checks: pure functions of a run record (and, for memory, the plan).

(a) mode contract  (b) memory, plan vs measured per device  (c) training step: finite, and the
loss falls when overfitting one fixed batch  (d) quality: the held-out metric before and after,
with settings and training time  (f) instability: a scan of the run's loss and grad-norm history.
(e) resume runs processes and lives in accept.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trainplan.plan.ledger import GROUPS
from trainplan.run import guard
from trainplan.run.record import RunRecord
from trainplan.spec.devices import format_gib


@dataclass
class Check:
    key: str
    name: str
    passed: bool | None  # None: does not apply to this mode
    summary: str
    evidence: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ---- (a) contract ---------------------------------------------------------------------------


def check_contract(record: RunRecord) -> Check:
    c = record.contract
    return Check("contract", "Mode contract", c["passed"], f"{c['mode']}: {c['detail']}", c)


# ---- (b) memory -----------------------------------------------------------------------------


def _row(device: str, phase: str, component: str, components: list, planned: int, measured: int, scale: int, ok: bool):
    """One plan-vs-measured row; `scale`: what its error is a fraction of (the device's measured peak)."""
    return {
        "device": device,
        "phase": phase,
        "component": component,
        "components": components,
        "planned": planned,
        "measured": measured,
        "abs_error": planned - measured,
        "rel_error": (planned - measured) / measured if measured else None,
        "error_of_peak": (planned - measured) / scale if scale else 0.0,
        "ok": ok,
    }


# A pipeline stage's 1F1B step interleaves its micro-batches' forwards and backwards: one measured phase
# (features/pipeline_parallel/engine.py), planned as the larger of the plan's forward and backward.
INTERLEAVED = {"1f1b": ("forward", "backward")}


def planned_phase(dev, phase: str) -> dict:
    """The plan's components of a measured phase on one device."""
    if phase in INTERLEAVED:
        return dev.phases.get(max(INTERLEAVED[phase], key=dev.phase_total), {})
    return dev.phases.get(phase, {})


def compare_memory(ledger, measured: list[dict], tolerance: float) -> tuple[list[dict], list[dict]]:
    """Rows per device, phase and component group: plan, measured, abs and relative error.

    A row fails when |plan - measured| exceeds `tolerance` x that device's measured peak (the bytes
    activation offload moved: `tolerance` x the bytes measured).
    """
    rows, failures = [], []
    for rank, m in enumerate(measured):
        dev = ledger.devices[rank] if rank < len(ledger.devices) else ledger.devices[0]
        peak = m["peak_bytes"]
        label = f"rank {rank} ({m['device']})"
        for phase, got in m["phases"].items():
            want = planned_phase(dev, phase)
            # a compiled step is measured as totals (run/measure.py CompiledStepMeter)
            groups = [("total", None)] if set(got) == {"total"} else [*GROUPS.items(), ("total", None)]
            for group, comps in groups:
                keys = comps or tuple((set(want) | set(got)) - {"total"})
                p, g = sum(want.get(c, 0) for c in keys), got.get("total", sum(got.get(c, 0) for c in keys))
                if p == 0 and g == 0:
                    continue
                parts = sorted(c for c in keys if want.get(c) or got.get(c))
                row = _row(label, phase, group, parts, p, g, peak, abs(p - g) <= tolerance * peak)
                rows.append(row)
                if not row["ok"]:
                    failures.append(row)
            cuda = m.get("cuda", {}).get(phase)
            if cuda:  # the allocator's own peak against the plan's phase total
                p = sum(want.values())
                g = cuda["max_allocated"]
                row = _row(
                    label,
                    phase,
                    "allocator (max_memory_allocated)",
                    [],
                    p,
                    g,
                    peak,
                    abs(p - g) <= tolerance * max(peak, g),
                )
                rows.append(row | {"reserved": cuda["max_reserved"], "nvml_used": cuda["nvml_used"]})
                if not rows[-1]["ok"]:
                    failures.append(rows[-1])
        if "offloaded_activation_bytes" in m:  # memory.offload_activations: what the hooks passed to the host
            p, g = dev.offloaded_activation_bytes, m["offloaded_activation_bytes"]
            # its error is a fraction of the bytes moved, the host's own scale
            rows.append(
                _row(
                    label,
                    "forward",
                    "offloaded activations (to the host)",
                    ["activations"],
                    p,
                    g,
                    g,
                    abs(p - g) <= tolerance * g,
                )
            )
            if not rows[-1]["ok"]:
                failures.append(rows[-1])
    return rows, failures


def compare_phases(ledger, measured: list[dict], step_peaks: list[int], tolerance: float) -> tuple[list, list]:
    """The run around the step (load, evaluate, save): each phase's planned total against the
    device's measured peak in it. A row fails past `tolerance` x the device's peak over the run."""
    rows, failures = [], []
    for rank, m in enumerate(measured):
        dev = ledger.devices[rank] if rank < len(ledger.devices) else ledger.devices[0]
        phases = [ph for ph in ("load", "evaluate", "save") if m.get(ph) is not None and ph in dev.phases]
        peak = max([m[ph] for ph in phases] + step_peaks[rank : rank + 1], default=0)
        for phase in phases:
            p, g = dev.phase_total(phase), m[phase]
            parts = sorted(c for c, v in dev.phases[phase].items() if v)
            row = _row(
                f"rank {rank} ({m['device']})", phase, "total", parts, p, g, peak, abs(p - g) <= tolerance * peak
            )
            rows.append(row)
            if not row["ok"]:
                failures.append(row)
    return rows, failures


def check_memory(record: RunRecord, ledger, tolerance: float) -> Check:
    mem = record.memory
    if not mem:
        return Check("memory", "Memory, plan vs measured per device", False, "no step was measured", {})
    rows, failures = compare_memory(ledger, mem["per_rank"], tolerance)
    if record.phase_memory:
        more, bad = compare_phases(
            ledger, record.phase_memory["per_rank"], [m["peak_bytes"] for m in mem["per_rank"]], tolerance
        )
        load = [r for r in more if r["phase"] == "load"]
        rows = load + rows + [r for r in more if r["phase"] != "load"]  # in the run's order
        failures += bad
    budget = under_budget(ledger, mem["per_rank"])
    worst = max(failures or rows, key=lambda r: abs(r["error_of_peak"]))
    peaks = {f"rank {i} ({m['device']})": m["peak_bytes"] for i, m in enumerate(mem["per_rank"])}
    parts = f" [{', '.join(worst['components'])}]" if worst["components"] else ""
    describe = (
        f"{worst['device']} {worst['phase']} {worst['component']}{parts}: "
        f"plan {format_gib(worst['planned'], 3)} vs measured "
        f"{format_gib(worst['measured'], 3)} ({worst['error_of_peak']:+.1%} of the device's measured peak)"
    )
    summary = (
        f"{len(failures)} of {len(rows)} rows outside ±{tolerance:.0%}; worst: {describe}"
        if failures
        else f"all {len(rows)} rows within ±{tolerance:.0%} of each device's measured peak; largest: {describe}"
    )
    if budget:
        over = [b for b in budget if not b["ok"]]
        summary += "; " + (
            f"{len(over)} of {len(budget)} devices over hardware.memory_budget: {over[0]['device']} measured "
            f"{format_gib(over[0]['measured_bill'], 3)} of {format_gib(over[0]['budget'], 3)}"
            if over
            else f"every device under hardware.memory_budget ({format_gib(budget[0]['budget'], 3)}); largest "
            f"{format_gib(max(b['measured_bill'] for b in budget), 3)}"
        )
    evidence = {
        "budget": budget,
        "tolerance": tolerance,
        "measured_step": mem["step"],
        "rows": rows,
        "peaks": peaks,
        "max_rss_bytes": [m["max_rss_bytes"] for m in mem["per_rank"]],
        "placement": [m["placement"] for m in mem["per_rank"]],
        "plan_fits": ledger.fits,
        "plan_verdict": ledger.verdict,
        "method": "storage tracker around one real step (every storage from creation to free, per phase), "
        "and around loading the weights, the last evaluation and saving the result (their peaks); "
        "CUDA adds max_memory_allocated/reserved and NVML per phase; RSS is recorded, not compared "
        "(it holds the interpreter, libraries and data)",
    }
    passed = not failures and all(b["ok"] for b in budget)
    return Check("memory", "Memory, plan vs measured per device", passed, summary, evidence)


def under_budget(ledger, measured: list[dict]) -> list[dict]:
    """hardware.memory_budget, proved on the run: each device's measured peak plus what the plan
    adds beside the allocator's bytes (the runtime and the allocator's reserve, which the storage
    tracker does not see) against the budget. Empty when no budget is set."""
    out = []
    for rank, m in enumerate(measured):
        dev = ledger.devices[rank] if rank < len(ledger.devices) else ledger.devices[0]
        if dev.budget_bytes is None:
            continue
        peak = m["peak_bytes"]
        bill = peak + dev.runtime_bytes + int(dev.reserve_fraction * peak)
        out.append(
            {
                "device": f"rank {rank} ({m['device']})",
                "measured_peak": peak,
                "measured_bill": bill,
                "budget": dev.budget_bytes,
                "ok": bill <= dev.budget_bytes,
            }
        )
    return out


# ---- (c) training step ----------------------------------------------------------------------


def _scaler_skipped(record: RunRecord) -> set[int]:
    """Steps the amp-fp16 GradScaler skipped for inf gradients: AMP working as designed, so their
    (infinite) grad norm is no instability."""
    if record.config["precision"] != "amp-fp16":
        return set()
    return {s["step"] for s in record.steps if s.get("skipped") and not math.isfinite(s["grad_norm"])}


def _scaler_free(record: RunRecord) -> list[dict]:
    skipped = _scaler_skipped(record)
    return [s for s in record.steps if s["step"] not in skipped]


def check_step(record: RunRecord, overfit: RunRecord | None) -> Check:
    if not record.training:
        finite = math.isfinite(record.eval_before["loss"])
        return Check(
            "step",
            "Training step",
            None,
            f"inference: no training step (forward loss finite: {finite})",
            {"eval_loss": record.eval_before["loss"]},
        )
    losses = [s["loss"] for s in record.steps]
    norms = [s["grad_norm"] for s in _scaler_free(record)]
    finite = all(math.isfinite(x) for x in losses + norms)
    fit = [s["loss"] for s in overfit.steps] if overfit else []
    falls = len(fit) >= 2 and all(math.isfinite(x) for x in fit) and fit[-1] < fit[0]
    summary = (
        f"loss and grad norm {'finite' if finite else 'NOT finite'} over {len(losses)} steps; "
        f"overfitting one fixed batch for {len(fit)} steps: loss {fit[0]:.4f} -> {fit[-1]:.4f}"
        if fit
        else "no overfit run"
    )
    return Check(
        "step",
        "Training step",
        finite and falls,
        summary,
        {"finite": finite, "overfit_losses": fit, "losses": losses, "grad_norms": norms},
    )


# ---- (d) quality ----------------------------------------------------------------------------


def check_quality(record: RunRecord) -> Check:
    before, after = record.eval_before, record.eval_after
    cfg = record.config
    b = record.batch
    settings = {
        "mode": cfg["mode"],
        "precision": cfg["precision"],
        "model": record.model.get("name", cfg["model"]["source"]),
        "lr": cfg["optim"]["lr"],
        "steps": len(record.steps),
        "global_batch": b["global"],
        "seq_len": b["seq_len"],
        "seed": cfg["train"]["seed"],
        "data": record.data,
    }
    evidence = {
        "metric": "held-out mean token cross-entropy (lower is better); perplexity and token accuracy beside it",
        "before": before,
        "after": after,
        "settings": settings,
        "train_seconds": record.train_seconds,
        "wall_seconds": record.wall_seconds,
        "evals": [{"step": s["step"], **s["eval"]} for s in record.steps if "eval" in s],
    }
    if cfg["mode"] == "inference":
        ok = math.isfinite(before["loss"]) and before == after
        return Check(
            "quality",
            "Quality (held-out)",
            ok,
            f"inference: held-out loss {before['loss']:.4f}, "
            f"perplexity {before['perplexity']:.2f}, unchanged by the run",
            evidence,
        )
    ok = math.isfinite(after["loss"]) and after["loss"] < before["loss"]
    summary = (
        f"held-out loss {before['loss']:.4f} -> {after['loss']:.4f}, perplexity {before['perplexity']:.2f} -> "
        f"{after['perplexity']:.2f}, token accuracy {before['token_accuracy']:.3f} -> {after['token_accuracy']:.3f} "
        f"on {after['tokens']} held-out tokens; {settings['steps']} steps in {record.train_seconds or 0:.1f} s"
    )
    return Check("quality", "Quality (held-out)", ok, summary, evidence)


# ---- (f) instability ------------------------------------------------------------------------


def check_instability(record: RunRecord) -> Check:
    """Fails on a non-finite loss or grad norm, or a loss spike. A grad-norm spike that gradient
    clipping bounded, with no loss spike after it, is recorded as a warning: the update was clipped."""
    if not record.training:
        return Check("instability", "Instability scan", None, "inference: no training history", {})
    min_history = min(10, guard.WINDOW // 2)
    scan = guard.scan(record.steps, min_history=min_history, ignore=_scaler_skipped(record))
    clip = record.config["train"]["max_grad_norm"]
    events = scan["events"]
    failing = [e for e in events if e["kind"] == "non-finite" or e["key"] == "loss"]
    warnings = [e for e in events if e not in failing]
    for e in warnings:
        e["note"] = f"clipped to {clip:g} (train.max_grad_norm); no loss spike followed"

    def describe(e: dict) -> str:
        z = f", z {e['z']:g}" if "z" in e else ""
        return f"step {e['step']} {e['key']} {e['kind']} ({e['value']:.4g}{z})"

    checked = min(scan["z_checked_steps"].values())
    summary = (
        f"{len(failing)} event(s): " + "; ".join(describe(e) for e in failing[:3])
        if failing
        else f"no non-finite value and no loss spike above {scan['threshold']:g} sigma in {scan['steps']} steps "
        f"(z-score checked on {checked} steps, once {min_history} were in the window)"
    )
    if warnings:
        summary += "; warning: " + "; ".join(describe(e) for e in warnings[:3]) + f", clipped to {clip:g}"
    acted = record.guard_events
    if acted:
        summary += "; the run's guard acted: " + "; ".join(
            f"step {e['step']} {e['key']} {e['kind']} -> {e['action']}" for e in acted[:3]
        )
    evidence = {**scan, "warnings": warnings, "guard_events": acted}
    return Check("instability", "Instability scan", not failing, summary, evidence)
