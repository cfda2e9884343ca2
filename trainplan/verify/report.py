"""The acceptance report: JSON for machines, Markdown, and one self-contained HTML page.

The HTML page has no external reference (no script, font or stylesheet to fetch): its plots are
inline SVG drawn here, so it opens offline and renders the same anywhere.
"""

from __future__ import annotations

import html
import json
import math

from trainplan.spec.devices import format_gib
from trainplan.text import md

GROUP_COLORS = {
    "states": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer": "#59a14f",
    "activations+": "#e15759",
}
LINE_COLORS = ("#4e79a7", "#e15759", "#59a14f", "#b07aa1")


def _gib3(n: float) -> str:
    return format_gib(n, 3, unit=False)


def _pct(x: float) -> str:
    return f"{x:+.2%}".replace("-0.00%", "+0.00%")


def _status(passed) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def _memory_check(result: dict) -> dict:
    return next(c for c in result["checks"] if c["key"] == "memory")


# ---- Markdown -------------------------------------------------------------------------------


def render_markdown(result: dict) -> str:
    rec = result["record"]
    lines = [
        f"# trainplan accept: {result['verdict']}",
        "",
        f"Model {md(rec['model'].get('name', rec['config']['model']['source']))}, mode {md(rec['config']['mode'])}, "
        f"{md(result['plan']['settings']['summary'])}; devices {md(rec['hardware']['devices'])}. "
        f"Acceptance took {result['seconds']:.0f} s.",
        "",
    ]
    if result["failing"]:
        lines += ["## Failing", ""] + [f"- {md(f)}" for f in result["failing"]] + [""]
    if result.get("perturbed"):
        lines += [f"Plan perturbed on purpose (test hook): {md(result['perturbed'])}", ""]
    lines += ["## Checks", "", "| check | result | evidence |", "|---|---|---|"]
    by_key = {c["key"]: c for c in result["checks"]}
    for key in result["order"]:
        c = by_key[key]
        lines.append(f"| {c['name']} | {_status(c['passed'])} | {md(c['summary'])} |")
    mem = _memory_check(result)
    if mem["evidence"].get("rows"):
        ev = mem["evidence"]
        lines += [
            "",
            f"## Memory per device (GiB; measured step {ev['measured_step']}; tolerance ±{ev['tolerance']:.0%} "
            "of the device's measured peak)",
            "",
            "| device | phase | component | planned | measured | abs error | rel error | of peak | ok |",
            "|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in ev["rows"]:
            rel = "-" if r["rel_error"] is None else f"{r['rel_error']:+.2%}"
            lines.append(
                f"| {md(r['device'])} | {r['phase']} | {r['component']} | {_gib3(r['planned'])} | "
                f"{_gib3(r['measured'])} | "
                f"{_gib3(r['abs_error'])} | {rel} | {_pct(r['error_of_peak'])} | {'yes' if r['ok'] else 'NO'} |"
            )
        lines += ["", "Placement (parameters per device):", ""]
        for rank, place in enumerate(ev["placement"]):
            for dev, p in place.items():
                lines.append(
                    f"- rank {rank}: {md(dev)}: {p['parameters']} parameters, {_gib3(p['bytes'])} GiB"
                    + (f", {p['sharded']} sharded (local shard)" if p["sharded"] else "")
                )
        lines += [f"- max RSS per rank: {', '.join(_gib3(x) + ' GiB' for x in ev['max_rss_bytes'])}", ""]
    q = next(c for c in result["checks"] if c["key"] == "quality")["evidence"]
    lines += [
        "## Quality",
        "",
        f"Metric: {q['metric']}.",
        "",
        "| | loss | perplexity | token accuracy | tokens |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {e['loss']:.4f} | {e['perplexity']:.2f} | {e['token_accuracy']:.4f} | {e['tokens']} |"
            for name, e in (("before", q["before"]), ("after", q["after"]))
        ),
        "",
        f"Settings: {md(json.dumps({k: v for k, v in q['settings'].items() if k != 'data'}))}; data "
        f"{md(q['settings']['data']['source'])} ({q['settings']['data']['train_documents']} training / "
        f"{q['settings']['data']['eval_documents']} held-out documents, fingerprint "
        f"{q['settings']['data']['fingerprint']}); training time {q['train_seconds'] or 0:.1f} s.",
        "",
    ]
    return "\n".join(lines)


# ---- SVG ------------------------------------------------------------------------------------


def _esc(s) -> str:
    return html.escape(str(s))


def _axis_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def svg_lines(series: list[tuple[str, list[tuple[float, float]]]], *, title: str, xlabel: str, ylabel: str) -> str:
    """A line chart; each series (name, points). Markers on every point; non-finite values are
    left out (a skipped fp16 step's infinite grad norm)."""
    series = [(name, [(x, y) for x, y in s if math.isfinite(y)]) for name, s in series]
    w, h, left, right, top, bottom = 640, 300, 64, 16, 32, 44
    pts = [p for _, s in series for p in s]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    pad = (y1 - y0) * 0.08 or abs(y1) * 0.05 or 1
    y0, y1 = y0 - pad, y1 + pad
    x1 = x1 if x1 > x0 else x0 + 1

    def sx(x):
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def sy(y):
        return top + (y1 - y) / (y1 - y0) * (h - top - bottom)

    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">']
    out.append(f'<text x="{w / 2}" y="18" text-anchor="middle" class="title">{_esc(title)}</text>')
    for t in _axis_ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>')
        out.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.3g}</text>')
    for t in _axis_ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{h - bottom + 16}" text-anchor="middle">{t:.3g}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 6}" text-anchor="middle">{_esc(xlabel)}</text>')
    out.append(
        f'<text x="14" y="{h / 2}" text-anchor="middle" transform="rotate(-90 14 {h / 2})">{_esc(ylabel)}</text>'
    )
    for i, (name, s) in enumerate(series):
        color = LINE_COLORS[i % len(LINE_COLORS)]
        if len(s) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in s:
            out.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{color}"><title>{_esc(name)} '
                f"{x:g}: {y:.4g}</title></circle>"
            )
        out.append(f'<rect x="{left + 10 + 150 * i}" y="{top - 2}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{left + 26 + 150 * i}" y="{top + 8}">{_esc(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def svg_memory(rows: list[dict]) -> str:
    """Per device and phase, a planned and a measured bar, stacked by component group."""
    groups = list(GROUP_COLORS)
    bars: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
    for r in rows:
        if r["component"] in groups:
            key = (r["device"], r["phase"])
            bars.setdefault(key, {"plan": {}, "measured": {}})
            bars[key]["plan"][r["component"]] = r["planned"]
            bars[key]["measured"][r["component"]] = r["measured"]
    if not bars:
        return ""
    top_bytes = max(sum(v.values()) for b in bars.values() for v in b.values()) or 1
    bw, gap = 28, 26
    left, top, bottom = 64, 40, 70
    w = left + len(bars) * (2 * bw + gap) + 140
    h = 340
    scale = (h - top - bottom) / top_bytes
    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">']
    out.append(
        f'<text x="{w / 2}" y="18" text-anchor="middle" class="title">Memory per device: plan (P) vs '
        "measured (M), by component</text>"
    )
    for t in _axis_ticks(0, top_bytes):
        y = h - bottom - t * scale
        out.append(f'<line x1="{left}" x2="{w - 140}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{t / 2**30:.2f}</text>')
    out.append(f'<text x="14" y="{h / 2}" text-anchor="middle" transform="rotate(-90 14 {h / 2})">GiB</text>')
    x = left + gap / 2
    for (device, phase), b in bars.items():
        for which, label in (("plan", "P"), ("measured", "M")):
            y = h - bottom
            for g in groups:
                v = b[which].get(g, 0)
                if v <= 0:
                    continue
                hh = v * scale
                y -= hh
                out.append(
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw}" height="{hh:.1f}" fill="{GROUP_COLORS[g]}">'
                    f"<title>{_esc(device)} {phase} {which} {g}: {v / 2**30:.3f} GiB</title></rect>"
                )
            out.append(f'<text x="{x + bw / 2:.1f}" y="{h - bottom + 14}" text-anchor="middle">{label}</text>')
            x += bw
        out.append(f'<text x="{x - bw:.1f}" y="{h - bottom + 30}" text-anchor="middle">{_esc(phase)}</text>')
        out.append(
            f'<text x="{x - bw:.1f}" y="{h - bottom + 44}" text-anchor="middle" class="small">{_esc(device)}</text>'
        )
        x += gap
    for i, g in enumerate(groups):
        out.append(f'<rect x="{w - 130}" y="{top + 20 * i}" width="12" height="12" fill="{GROUP_COLORS[g]}"/>')
        out.append(f'<text x="{w - 112}" y="{top + 10 + 20 * i}">{g}</text>')
    out.append("</svg>")
    return "\n".join(out)


# ---- HTML -----------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 .PASS, td.PASS { color: #1a7f37; } h1 .FAIL, td.FAIL { color: #c62828; } td.na { color: #777; }
table { border-collapse: collapse; margin: 8px 0 16px; } td, th { border: 1px solid #ddd; padding: 4px 8px; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fdecea; } .failing { border: 2px solid #c62828; padding: 8px 16px; background: #fff5f5; }
svg.plot { display: block; margin: 12px 0; background: #fff; border: 1px solid #eee; }
svg text { font: 11px system-ui, sans-serif; fill: #333; } svg text.title { font-weight: 600; font-size: 13px; }
svg text.small { font-size: 9px; } svg line.grid { stroke: #e6e6e6; }
"""


def render_html(result: dict) -> str:
    rec = result["record"]
    verdict = result["verdict"]
    mem = _memory_check(result)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>trainplan accept: {verdict}</title><style>{CSS}</style></head><body>",
        f"<h1>trainplan accept: <span class='{verdict}'>{verdict}</span></h1>",
        f"<p>{_esc(rec['model'].get('name', ''))} &middot; {_esc(result['plan']['settings']['summary'])} &middot; "
        f"devices {_esc(rec['hardware']['devices'])} &middot; {result['seconds']:.0f} s</p>",
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
    rows = mem["evidence"].get("rows", [])
    if rows:
        parts += ["<h2>Memory per device</h2>", svg_memory(rows)]
        parts.append(
            "<table><tr><th>device</th><th>phase</th><th>component</th><th>planned GiB</th><th>measured GiB</th>"
            "<th>abs error GiB</th><th>of peak</th></tr>"
        )
        for r in rows:
            cls = "" if r["ok"] else " class='bad'"
            parts.append(
                f"<tr{cls}><td>{_esc(r['device'])}</td><td>{r['phase']}</td><td>{_esc(r['component'])}</td>"
                f"<td class='num'>{_gib3(r['planned'])}</td><td class='num'>{_gib3(r['measured'])}</td>"
                f"<td class='num'>{_gib3(r['abs_error'])}</td><td class='num'>{_pct(r['error_of_peak'])}</td></tr>"
            )
        parts.append("</table>")
    steps = rec.get("steps", [])
    if steps:
        series = [("train loss", [(s["step"], s["loss"]) for s in steps])]
        q = by_key["quality"]["evidence"]
        evals = [(0, q["before"]["loss"])] + [(e["step"], e["loss"]) for e in q["evals"]]
        evals.append((steps[-1]["step"], q["after"]["loss"]))
        series.append(("held-out loss", evals))
        overfit = by_key["step"]["evidence"].get("overfit_losses") or []
        if overfit:
            series.append(("overfit one batch", [(i + 1, v) for i, v in enumerate(overfit)]))
        parts += ["<h2>Loss and evaluation</h2>", svg_lines(series, title="Loss", xlabel="step", ylabel="loss")]
        parts.append(
            svg_lines(
                [("grad norm (before clipping)", [(s["step"], s["grad_norm"]) for s in steps])],
                title="Gradient norm",
                xlabel="step",
                ylabel="L2 norm",
            )
        )
        parts.append(
            svg_lines(
                [("seconds per step", [(s["step"], s["seconds"]) for s in steps])],
                title="Step time",
                xlabel="step",
                ylabel="seconds",
            )
        )
    parts.append(
        "<h2>Run</h2><pre>"
        + _esc(json.dumps({"config": rec["config"], "versions": rec.get("versions")}, indent=1))
        + "</pre></body></html>"
    )
    return "\n".join(p for p in parts if p)
