"""`trainplan accept`: the acceptance run, one verdict from six recorded checks.

(a) mode contract  (b) memory, plan vs measured per device  (c) training step: finite, and the
loss falls when overfitting one fixed batch  (d) quality: the held-out metric before and after,
with settings and training time  (e) resume: verify-resume at a small scale  (f) instability:
a scan of the run's loss and grad-norm history.

Each check records its evidence; the verdict is PASS only when every check that applies passed.
A run that succeeds is not yet a useful result (d), a server's total memory says nothing about
placement (b, per device, never pooled), and a checkpoint counts only when the code can load it
and continue (e).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainplan import config as C
from trainplan.errors import ConfigError

# The embedded default: LoRA on SmolLM2-135M-Instruct with the Python docs, sized for a 2-core CPU.
DEFAULT_SETTINGS = [
    "mode='lora'",
    "precision='fp32'",
    "model.source='default'",
    "lora.r=8",
    "lora.alpha=16",
    "lora.dropout=0.05",
    "lora.target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']",
    "optim.lr=1e-3",
    "batch.seq_len=256",
    "batch.micro_batch_size=4",
    "train.steps=20",
    "train.eval_batches=8",
    "hardware.gpus='auto'",
]
TOLERANCE = 0.05  # of the measured peak allocated, per device


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


def check_contract(record: dict) -> Check:
    c = record["contract"]
    return Check("contract", "Mode contract", c["passed"], f"{c['mode']}: {c['detail']}", c)


# ---- (b) memory -----------------------------------------------------------------------------


def perturbed(ledger, perturb: dict[str, float] | None):
    """The plan with components scaled (a test hook: proves the memory check can fail)."""
    if not perturb:
        return ledger
    known = {c for d in ledger.devices for ph in d.phases.values() for c in ph}
    for comp in perturb:
        if comp not in known:
            raise ConfigError("--perturb-plan", f"no component {comp!r} in the plan", f"use one of {sorted(known)}")
    devices = [
        dataclasses.replace(
            d,
            phases={ph: {c: int(v * perturb.get(c, 1.0)) for c, v in comps.items()} for ph, comps in d.phases.items()},
        )
        for d in ledger.devices
    ]
    return dataclasses.replace(ledger, devices=devices)


def compare_memory(ledger, measured: list[dict], tolerance: float) -> tuple[list[dict], list[dict]]:
    """Rows per device, phase and component group: plan, measured, abs and relative error.

    A row fails when |plan - measured| exceeds `tolerance` x that device's measured peak.
    """
    from trainplan.plan.traced import GROUPS

    rows, failures = [], []
    for rank, m in enumerate(measured):
        dev = ledger.devices[rank] if rank < len(ledger.devices) else ledger.devices[0]
        peak = m["peak_bytes"]
        label = f"rank {rank} ({m['device']})"
        for phase, got in m["phases"].items():
            want = dev.phases.get(phase, {})
            for group, comps in [*GROUPS.items(), ("total", None)]:
                keys = comps or tuple(set(want) | set(got))
                p, g = sum(want.get(c, 0) for c in keys), sum(got.get(c, 0) for c in keys)
                if p == 0 and g == 0:
                    continue
                err = p - g
                row = {
                    "device": label,
                    "phase": phase,
                    "component": group,
                    "components": sorted(c for c in keys if want.get(c) or got.get(c)),
                    "planned": p,
                    "measured": g,
                    "abs_error": err,
                    "rel_error": err / g if g else None,
                    "error_of_peak": err / peak if peak else 0.0,
                    "ok": abs(err) <= tolerance * peak,
                }
                rows.append(row)
                if not row["ok"]:
                    failures.append(row)
            cuda = m.get("cuda", {}).get(phase)
            if cuda:  # the allocator's own peak against the plan's phase total
                p = sum(want.values())
                g = cuda["max_allocated"]
                rows.append(
                    {
                        "device": label,
                        "phase": phase,
                        "component": "allocator (max_memory_allocated)",
                        "components": [],
                        "planned": p,
                        "measured": g,
                        "abs_error": p - g,
                        "rel_error": (p - g) / g if g else None,
                        "error_of_peak": (p - g) / peak if peak else 0.0,
                        "ok": abs(p - g) <= tolerance * max(peak, g),
                        "reserved": cuda["max_reserved"],
                        "nvml_used": cuda["nvml_used"],
                    }
                )
                if not rows[-1]["ok"]:
                    failures.append(rows[-1])
    return rows, failures


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def check_memory(record: dict, ledger, tolerance: float) -> Check:
    mem = record.get("memory")
    if not mem:
        return Check("memory", "Memory, plan vs measured per device", False, "no step was measured", {})
    rows, failures = compare_memory(ledger, mem["per_rank"], tolerance)
    worst = max(failures or rows, key=lambda r: abs(r["error_of_peak"]))
    peaks = {f"rank {i} ({m['device']})": m["peak_bytes"] for i, m in enumerate(mem["per_rank"])}
    parts = f" [{', '.join(worst['components'])}]" if worst["components"] else ""
    describe = (
        f"{worst['device']} {worst['phase']} {worst['component']}{parts}: plan {_gib(worst['planned'])} vs measured "
        f"{_gib(worst['measured'])} ({worst['error_of_peak']:+.1%} of the device's measured peak)"
    )
    summary = (
        f"{len(failures)} of {len(rows)} rows outside ±{tolerance:.0%}; worst: {describe}"
        if failures
        else f"all {len(rows)} rows within ±{tolerance:.0%} of each device's measured peak; largest: {describe}"
    )
    evidence = {
        "tolerance": tolerance,
        "measured_step": mem["step"],
        "rows": rows,
        "peaks": peaks,
        "max_rss_bytes": [m["max_rss_bytes"] for m in mem["per_rank"]],
        "placement": [m["placement"] for m in mem["per_rank"]],
        "plan_fits": ledger.fits,
        "plan_verdict": ledger.verdict,
        "method": "storage tracker around one real step (every storage from creation to free, per phase); "
        "CUDA adds max_memory_allocated/reserved and NVML per phase; RSS is recorded, not compared "
        "(it holds the interpreter, libraries and data)",
    }
    return Check("memory", "Memory, plan vs measured per device", not failures, summary, evidence)


# ---- (c) training step ----------------------------------------------------------------------


def _scaler_skipped(record: dict) -> set[int]:
    """Steps the amp-fp16 GradScaler skipped for inf gradients: AMP working as designed, so their
    (infinite) grad norm is no instability."""
    if record["config"]["precision"] != "amp-fp16":
        return set()
    return {s["step"] for s in record["steps"] if s.get("skipped") and not math.isfinite(s["grad_norm"])}


def _scaler_free(record: dict) -> list[dict]:
    skipped = _scaler_skipped(record)
    return [s for s in record["steps"] if s["step"] not in skipped]


def check_step(record: dict, overfit: dict | None) -> Check:
    if record["config"]["mode"] == "inference":
        finite = math.isfinite(record["eval_before"]["loss"])
        return Check(
            "step",
            "Training step",
            None,
            f"inference: no training step (forward loss finite: {finite})",
            {"eval_loss": record["eval_before"]["loss"]},
        )
    losses = [s["loss"] for s in record["steps"]]
    norms = [s["grad_norm"] for s in _scaler_free(record)]
    finite = all(math.isfinite(x) for x in losses + norms)
    fit = [s["loss"] for s in overfit["steps"]] if overfit else []
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


def check_quality(record: dict) -> Check:
    before, after = record["eval_before"], record["eval_after"]
    cfg = record["config"]
    b = record["batch"]
    settings = {
        "mode": cfg["mode"],
        "precision": cfg["precision"],
        "model": record["model"].get("name", cfg["model"]["source"]),
        "lr": cfg["optim"]["lr"],
        "steps": len(record["steps"]),
        "global_batch": b["global"],
        "seq_len": b["seq_len"],
        "seed": cfg["train"]["seed"],
        "data": record["data"],
    }
    evidence = {
        "metric": "held-out mean token cross-entropy (lower is better); perplexity and token accuracy beside it",
        "before": before,
        "after": after,
        "settings": settings,
        "train_seconds": record.get("train_seconds"),
        "wall_seconds": record.get("wall_seconds"),
        "evals": [{"step": s["step"], **s["eval"]} for s in record["steps"] if "eval" in s],
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
        f"on {after['tokens']} held-out tokens; {settings['steps']} steps in {record.get('train_seconds', 0):.1f} s"
    )
    return Check("quality", "Quality (held-out)", ok, summary, evidence)


# ---- (e) resume -----------------------------------------------------------------------------


def check_resume(config_file: Path, workdir: Path, *, steps: int, at: int, nproc: int, mode: str) -> Check:
    if mode == "inference":
        return Check("resume", "Resume", None, "inference: no optimizer state or progress to resume", {})
    from trainplan.verify.resume import verify

    small = ["train.eval_batches=1", "train.eval_every=0", "train.measure_memory=false"]
    args = [str(config_file), *(x for item in small for x in ("--set", item))]
    try:
        result = verify(args, steps=steps, at=at, workdir=workdir, nproc=nproc)
    except RuntimeError as e:
        return Check("resume", "Resume", False, str(e), {})
    failed = [k for k, ok in result["checks"].items() if not ok]
    summary = f"N={steps} uninterrupted vs stop at k={at} + resume in a fresh process: " + (
        "bitwise equal (loss, grad norm, LR, next batch, weights and optimizer hashes)"
        if not failed
        else f"differs in {', '.join(failed)}; largest deviation {result['max_deviation']}"
    )
    return Check("resume", "Resume", result["passed"], summary, result)


# ---- (f) instability ------------------------------------------------------------------------


def check_instability(record: dict) -> Check:
    """Fails on a non-finite loss or grad norm, or a loss spike. A grad-norm spike that gradient
    clipping bounded, with no loss spike after it, is recorded as a warning: the update was clipped."""
    from trainplan.run import guard

    if record["config"]["mode"] == "inference":
        return Check("instability", "Instability scan", None, "inference: no training history", {})
    min_history = min(10, guard.WINDOW // 2)
    scan = guard.scan(record["steps"], min_history=min_history, ignore=_scaler_skipped(record))
    clip = record["config"]["train"]["max_grad_norm"]
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
    acted = record.get("guard", {}).get("events", [])
    if acted:
        summary += "; the run's guard acted: " + "; ".join(
            f"step {e['step']} {e['key']} {e['kind']} -> {e['action']}" for e in acted[:3]
        )
    evidence = {**scan, "warnings": warnings, "guard_events": acted}
    return Check("instability", "Instability scan", not failing, summary, evidence)


def _device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


# ---- the run --------------------------------------------------------------------------------


def accept(
    cfg: C.RunConfig,
    *,
    out_dir: Path,
    tolerance: float = TOLERANCE,
    perturb: dict[str, float] | None = None,
    resume_steps: int = 4,
    resume_at: int = 2,
    overfit_steps: int = 6,
    nproc: int = 1,
) -> dict:
    """Run the checks in order; returns the result (also the input of the report)."""
    from trainplan.plan import analytic
    from trainplan.run import loop
    from trainplan.verify.resume import run_train

    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    main_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(out_dir / "train")))
    config_file = out_dir / "config.toml"
    config_file.write_text(C.to_toml(main_cfg))
    if nproc > 1:
        record = run_train([str(config_file)], out_dir / "train", nproc=nproc)
    else:
        record = loop.run(main_cfg, quiet=True, register=False)
        record.pop("_env", None)
    ledger = perturbed(analytic.plan(C.from_dict(record["config"])), perturb)

    overfit = None
    if cfg.mode != "inference":
        fit_cfg = dataclasses.replace(
            main_cfg,
            train=dataclasses.replace(
                main_cfg.train,
                steps=overfit_steps,
                overfit_batches=1,
                eval_batches=1,
                eval_every=0,
                stop_after=0,
                measure_memory=False,
                output_dir=str(out_dir / "overfit"),
            ),
            checkpoint=dataclasses.replace(main_cfg.checkpoint, every=0, resume=""),
            data=main_cfg.data,
        )
        overfit = loop.run(fit_cfg, quiet=True, register=False)
        overfit.pop("_env", None)

    checks = [
        check_contract(record),
        check_memory(record, ledger, tolerance),
        check_step(record, overfit),
        check_quality(record),
        check_resume(config_file, out_dir / "resume", steps=resume_steps, at=resume_at, nproc=nproc, mode=cfg.mode),
        check_instability(record),
    ]
    passed = all(c.passed is not False for c in checks)
    failing = [c for c in checks if c.passed is False]
    return {
        "schema": "trainplan.accept/1",
        "verdict": "PASS" if passed else "FAIL",
        "failing": [f"{c.name}: {c.summary}" for c in failing],
        "checks": [c.to_json() for c in failing + [c for c in checks if c.passed is not False]],
        "order": [c.key for c in checks],
        "plan": ledger.to_json(),
        "perturbed": perturb or {},
        "record": {k: v for k, v in record.items() if k != "memory"},
        "memory": record.get("memory"),
        "device_name": _device_name(record["hardware"]["device"]),
        "seconds": time.perf_counter() - t0,
        "out_dir": str(out_dir),
    }
