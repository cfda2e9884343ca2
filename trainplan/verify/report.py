"""The acceptance report: JSON for machines, Markdown, and one self-contained HTML page.

The HTML page has no external reference (no script, font or stylesheet to fetch): its plots are
matplotlib figures inlined as SVG (verify/plots.py), so it opens offline and renders the same
anywhere. Both pages read one duration, the record's `wall_seconds` (see RUN_TIME).
"""

from __future__ import annotations

import html

from trainplan import features
from trainplan.run.progress import duration
from trainplan.spec.devices import format_gib
from trainplan.text import md
from trainplan.verify import plots

RUN_TIME = "run wall time"  # the record's wall_seconds: load, evaluations, steps and save of the run


def _gib3(n: float) -> str:
    return format_gib(n, 3, unit=False)


def _pct(x: float) -> str:
    return f"{x:+.2%}".replace("-0.00%", "+0.00%")


def rel_error(row: dict) -> str:
    """The plan's error relative to the measurement; '—' when either side shows as 0.000 GiB
    (a percentage of nothing says nothing)."""
    if row["rel_error"] is None or round(row["planned"] / 2**30, 3) == 0 or round(row["measured"] / 2**30, 3) == 0:
        return "—"
    return _pct(row["rel_error"])


def _status(passed) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def _check(result: dict, key: str) -> dict:
    return next(c for c in result["checks"] if c["key"] == key)


def _seconds(x: float | None) -> str:
    return "n/a" if x is None else duration(x)


def run_wall_time(result: dict) -> str:
    return _seconds(result["record"].get("wall_seconds"))


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def run_facts(result: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The Run section: (heading, [(name, value)]) for settings, model, data, devices, durations
    and versions; shared by the Markdown and HTML pages."""
    rec = result["record"]
    cfg, b, model, data = rec["config"], rec["batch"], rec["model"], rec["data"]
    train, optim = cfg["train"], cfg["optim"]
    settings = result["plan"]["settings"]
    evaluation = (
        f"every {train['eval_every']} steps and after the last"
        if train.get("eval_every")
        else "before and after training only"
    )
    batches = train.get("eval_batches")
    evaluation += f"; {batches} micro-batches each" if batches else "; the whole held-out split each"
    rows = [
        ("mode", cfg["mode"]),
        ("precision", cfg["precision"]),
        ("parallelism", settings.get("parallel", "")),
        ("steps", f"{len(rec.get('steps', []))} of {train['steps']}"),
        (
            "batch",
            f"micro-batch {b['micro_batch_size']} x accumulation {b['grad_accum_steps']} x data-parallel "
            f"{b['global'] // (b['micro_batch_size'] * b['grad_accum_steps'])} = global {b['global']} sequences of "
            f"{b['seq_len']} tokens",
        ),
        ("optimizer", f"{optim['name']}, lr {optim['lr']:g}, weight decay {optim.get('weight_decay', 0):g}"),
        ("schedule", f"{train['schedule']}, {train['warmup_steps']} warmup steps"),
        ("gradient clipping", f"max norm {train['max_grad_norm']:g}" if train["max_grad_norm"] else "off"),
        ("evaluation", evaluation),
        ("seed", str(rec["seed"])),
    ]
    lora = cfg.get("lora")
    if cfg["mode"] in features.lora.ADAPTER_MODES and lora:
        targets = ", ".join(lora["target_modules"])
        expanded = ", ".join((settings.get("lora") or {}).get("target_modules") or [])
        if expanded and expanded != targets:  # a named set, as resolve() expanded it for this model
            targets += f" ({expanded})"
        rows.insert(2, ("LoRA", f"r {lora['r']}, alpha {lora['alpha']:g}, dropout {lora['dropout']:g} on {targets}"))
    model_rows = [
        ("name", str(model.get("name", cfg["model"]["source"]))),
        ("source", str(cfg["model"]["source"])),
        ("parameters", _params(model["params"]) if "params" in model else "n/a"),
        (
            "shape",
            f"{model.get('model_type', '?')}: {model.get('layers', '?')} layers, hidden {model.get('hidden', '?')}, "
            f"{model.get('heads', '?')} heads ({model.get('kv_heads', '?')} KV), vocabulary {model.get('vocab', '?')}",
        ),
    ]
    data_rows = [
        ("source", str(data["source"])),
        ("fingerprint", str(data["fingerprint"])),
        ("documents", f"{data['train_documents']} training, {data['eval_documents']} held-out"),
        ("sequences", f"{data['train_sequences']} training, {data['eval_sequences']} held-out"),
    ]
    hw = rec["hardware"]
    device_rows = [
        ("devices", f"{hw['devices']} ({result.get('device_name', hw['device'])})"),
        ("world size", str(hw["world_size"])),
    ]
    time_rows = [
        (RUN_TIME, f"{run_wall_time(result)} (load, evaluations, training steps, save)"),
        ("of which training steps", _seconds(rec.get("train_seconds"))),
    ]
    versions = [(k, str(v)) for k, v in (rec.get("versions") or {}).items()]
    return [
        ("Settings", rows),
        ("Model", model_rows),
        ("Data", data_rows),
        ("Devices", device_rows),
        ("Duration", time_rows),
        ("Versions", versions),
    ]


def headline(result: dict) -> str:
    """One line: model, settings (the summary starts with the mode), devices, run wall time."""
    rec = result["record"]
    return (
        f"{rec['model'].get('name', rec['config']['model']['source'])}; {result['plan']['settings']['summary']}; "
        f"devices {rec['hardware']['devices']}; {RUN_TIME} {run_wall_time(result)}"
    )


# ---- Markdown -------------------------------------------------------------------------------


def render_markdown(result: dict) -> str:
    rec = result["record"]
    lines = [f"# trainplan accept: {result['verdict']}", "", md(headline(result)) + ".", ""]
    if result["failing"]:
        lines += ["## Failing", ""] + [f"- {md(f)}" for f in result["failing"]] + [""]
    if result.get("perturbed"):
        lines += [f"Plan perturbed on purpose (test hook): {md(result['perturbed'])}", ""]
    lines += ["## Checks", "", "| check | result | evidence |", "|---|---|---|"]
    by_key = {c["key"]: c for c in result["checks"]}
    for key in result["order"]:
        c = by_key[key]
        lines.append(f"| {c['name']} | {_status(c['passed'])} | {md(c['summary'])} |")
    ev = _check(result, "memory")["evidence"]
    if ev.get("rows"):
        lines += [
            "",
            f"## Memory per device (GiB; measured step {ev['measured_step']}; tolerance ±{ev['tolerance']:.0%} "
            "of the device's measured peak)",
            "",
            "| device | phase | component | planned | measured | abs error | rel error | of peak | ok |",
            "|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in ev["rows"]:
            lines.append(
                f"| {md(r['device'])} | {r['phase']} | {r['component']} | {_gib3(r['planned'])} | "
                f"{_gib3(r['measured'])} | {_gib3(r['abs_error'])} | {rel_error(r)} | {_pct(r['error_of_peak'])} | "
                f"{'yes' if r['ok'] else 'NO'} |"
            )
        lines += ["", "Placement (parameters per device):", ""]
        for rank, place in enumerate(ev["placement"]):
            for dev, p in place.items():
                lines.append(
                    f"- rank {rank}: {md(dev)}: {p['parameters']} parameters, {_gib3(p['bytes'])} GiB"
                    + (f", {p['sharded']} sharded (local shard)" if p["sharded"] else "")
                )
        lines += [f"- max RSS per rank: {', '.join(_gib3(x) + ' GiB' for x in ev['max_rss_bytes'])}", ""]
    q = _check(result, "quality")["evidence"]
    lines += [
        "## Quality",
        "",
        f"Metric: {q['metric']}.",
        "",
        "| evaluation | step | loss | perplexity | token accuracy | tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, step, e in evaluations(result):
        lines.append(
            f"| {name} | {step} | {e['loss']:.4f} | {e['perplexity']:.2f} | {e['token_accuracy']:.4f} | {e['tokens']} |"
        )
    lines.append("")
    samples = rec.get("samples") or []
    if samples:
        lines += ["## Generations before/after", "", "| prompt | before | after |", "|---|---|---|"]
        lines += [f"| {md(s['prompt'])} | {md(s['before'])} | {md(s['after'])} |" for s in samples]
        lines.append("")
    lines += ["## Run", ""]
    for heading, rows in run_facts(result):
        lines += [f"| {heading} | |", "|---|---|"] + [f"| {name} | {md(value)} |" for name, value in rows] + [""]
    return "\n".join(lines)


def evaluations(result: dict) -> list[tuple[str, int, dict]]:
    """Every held-out evaluation of the run: before, each periodic one, after."""
    rec = result["record"]
    q = _check(result, "quality")["evidence"]
    steps = rec.get("steps") or []
    out = [("before", 0, q["before"])]
    out += [("during", e["step"], e) for e in q.get("evals", [])]
    out.append(("after", steps[-1]["step"] if steps else 0, q["after"]))
    return out


# ---- HTML -----------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 .PASS, td.PASS { color: #1a7f37; } h1 .FAIL, td.FAIL { color: #c62828; } td.na { color: #777; }
table { border-collapse: collapse; margin: 8px 0 16px; } td, th { border: 1px solid #ddd; padding: 4px 8px; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fdecea; } .failing { border: 2px solid #c62828; padding: 8px 16px; background: #fff5f5; }
svg.plot { display: block; margin: 12px 0; max-width: 100%; height: auto; }
table.run th[colspan] { background: #e8eef6; } table.run td:first-child { color: #555; white-space: nowrap; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 12px; max-width: 420px; }
"""


def _esc(s) -> str:
    return html.escape(str(s))


def _table(head: list[str], rows: list[list[str]], *, numeric: set[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = "".join(
            f"<td class='num'>{_esc(c)}</td>" if i in numeric else f"<td>{_esc(c)}</td>" for i, c in enumerate(row)
        )
        out.append(f"<tr>{cells}</tr>")
    return "\n".join(out) + "</table>"


def _plots_html(result: dict) -> list[str]:
    rec = result["record"]
    steps = rec.get("steps") or []
    if not steps:
        return []
    q = _check(result, "quality")["evidence"]
    overfit = _check(result, "step")["evidence"].get("overfit_losses") or []
    return [
        "<h2>Loss and evaluation</h2>",
        plots.loss_svg(rec, q.get("evals", [])),
        plots.series_svg(
            [{"step": i + 1, "loss": v} for i, v in enumerate(overfit)],
            "loss",
            plot_id="plot-overfit",
            title="Training step check: loss on one fixed batch (the overfit run)",
            ylabel="loss (nats)",
            color=plots.OVERFIT_COLOR,
            zero=False,
        ),
        plots.series_svg(
            steps,
            "grad_norm",
            plot_id="plot-grad-norm",
            title="Gradient norm (before clipping)",
            ylabel="L2 norm",
            color=plots.TRAIN_COLOR,
        ),
        plots.series_svg(
            steps,
            "tokens_per_s",
            plot_id="plot-throughput",
            title="Throughput",
            ylabel="tokens/s (target tokens)",
            color=plots.LR_COLOR,
        ),
    ]


def render_html(result: dict) -> str:
    rec = result["record"]
    verdict = result["verdict"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>trainplan accept: {verdict}</title><style>{CSS}</style></head><body>",
        f"<h1>trainplan accept: <span class='{verdict}'>{verdict}</span></h1>",
        f"<p>{_esc(headline(result))}</p>",
    ]
    if result["failing"]:
        parts.append("<div class='failing'><h2>Failing</h2><ul>")
        parts += [f"<li>{_esc(f)}</li>" for f in result["failing"]]
        parts.append("</ul></div>")
    parts.append("<h2>Checks</h2><table><tr><th>check</th><th>result</th><th>evidence</th></tr>")
    by_key = {c["key"]: c for c in result["checks"]}
    for key in result["order"]:
        c = by_key[key]
        st = _status(c["passed"])
        parts.append(
            f"<tr><td>{_esc(c['name'])}</td><td class='{st.replace('/', '')}'>{st}</td>"
            f"<td>{_esc(c['summary'])}</td></tr>"
        )
    parts.append("</table>")
    rows = _check(result, "memory")["evidence"].get("rows", [])
    if rows:
        parts += ["<h2>Memory per device</h2>", plots.memory_svg(rows)]
        parts.append(
            "<table><tr><th>device</th><th>phase</th><th>component</th><th>planned GiB</th><th>measured GiB</th>"
            "<th>abs error GiB</th><th>rel error</th><th>of peak</th></tr>"
        )
        for r in rows:
            cls = "" if r["ok"] else " class='bad'"
            parts.append(
                f"<tr{cls}><td>{_esc(r['device'])}</td><td>{r['phase']}</td><td>{_esc(r['component'])}</td>"
                f"<td class='num'>{_gib3(r['planned'])}</td><td class='num'>{_gib3(r['measured'])}</td>"
                f"<td class='num'>{_gib3(r['abs_error'])}</td><td class='num'>{rel_error(r)}</td>"
                f"<td class='num'>{_pct(r['error_of_peak'])}</td></tr>"
            )
        parts.append("</table>")
    parts += _plots_html(result)
    if rec.get("steps"):
        parts += [
            "<h3>Held-out evaluations</h3>",
            _table(
                ["evaluation", "step", "loss", "perplexity", "token accuracy", "tokens"],
                [
                    [
                        name,
                        step,
                        f"{e['loss']:.4f}",
                        f"{e['perplexity']:.2f}",
                        f"{e['token_accuracy']:.4f}",
                        e["tokens"],
                    ]
                    for name, step, e in evaluations(result)
                ],
                numeric={1, 2, 3, 4, 5},
            ),
        ]
    samples = rec.get("samples") or []
    if samples:
        parts.append("<h2>Generations before/after</h2><table><tr><th>prompt</th><th>before</th><th>after</th></tr>")
        parts += [
            f"<tr><td class='text'>{_esc(s['prompt'])}</td><td class='text'>{_esc(s['before'])}</td>"
            f"<td class='text'>{_esc(s['after'])}</td></tr>"
            for s in samples
        ]
        parts.append("</table>")
    parts.append("<h2>Run</h2><table class='run'>")
    for heading, facts in run_facts(result):
        parts.append(f"<tr><th colspan='2'>{_esc(heading)}</th></tr>")
        parts += [f"<tr><td>{_esc(name)}</td><td>{_esc(value)}</td></tr>" for name, value in facts]
    parts.append("</table></body></html>")
    return "\n".join(p for p in parts if p)
