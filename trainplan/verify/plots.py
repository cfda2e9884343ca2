"""The acceptance report's plots: matplotlib figures as inline SVG, no external reference.

Figures are built on `matplotlib.figure.Figure` (no pyplot: no global state, no GUI backend) and
saved as SVG with text kept as text (`svg.fonttype: none`), so a tick label in the page is the
number it says. Every numeric axis takes its ticks from MaxNLocator with 1-2-2.5-5 steps: ticks
are round numbers in the unit named in the axis label.
"""

from __future__ import annotations

import io
import math
import re

import matplotlib
from matplotlib.figure import Figure
from matplotlib.ticker import Formatter, MaxNLocator

PLAN_COLOR = "#f28e2b"  # plan bars
MEASURED_COLOR = "#4e79a7"  # measured bars
TRAIN_COLOR = "#4e79a7"
HELD_OUT_COLOR = "#e15759"
OVERFIT_COLOR = "#8c8c8c"
LR_COLOR = "#59a14f"
NICE_STEPS = [1, 2, 2.5, 5, 10]
STEP_PHASES = ("forward", "backward", "optimizer")
GROUPS = ("states", "gradients", "optimizer", "activations+")
UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("bytes", 1))


class RoundFormatter(Formatter):
    """Tick labels with as many decimals as the ticks need, the same on the whole axis (0.5, 1.0,
    1.5; never 1e-3 offsets or exponents), and an ASCII minus."""

    places = 0

    def format_ticks(self, values) -> list[str]:
        self.places = decimals(values)
        return [self(v) for v in values]

    def __call__(self, x, pos=None) -> str:
        return tick_text(x, self.places)


def decimals(ticks) -> int:
    """The fewest decimals that write every tick exactly."""
    ticks = list(ticks)
    spacing = min((abs(b - a) for a, b in zip(ticks, ticks[1:], strict=False) if b != a), default=1.0)
    return next((d for d in range(12) if all(abs(round(t, d) - t) <= spacing * 1e-6 for t in ticks)), 12)


def tick_text(value: float, places: int) -> str:
    text = f"{value:.{places}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def _nice_axis(axis, *, integer: bool = False) -> None:
    axis.set_major_locator(MaxNLocator(nbins=6, steps=NICE_STEPS, integer=integer, min_n_ticks=3))
    axis.set_major_formatter(RoundFormatter())


def byte_unit(largest: float) -> tuple[str, int]:
    """The largest binary unit that keeps the biggest value at 1 or more."""
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def to_svg(fig: Figure, plot_id: str, title: str) -> str:
    """The figure as an inline <svg> element with an id and a <title>; the ids inside it are
    prefixed (and hashes salted) with the plot's id, so plots on one page never share an id."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": plot_id}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Title": title})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # the XML declaration and DOCTYPE do not belong inside HTML
    svg = re.sub(
        r"\bid=\"(figure|axes|patch|line2d|text|legend|xtick|ytick|matplotlib\.axis)_(\d+)\"",
        lambda m: f'id="{plot_id}-{m.group(1)}_{m.group(2)}"',
        svg,
    )
    head, rest = svg.split(">", 1)  # matplotlib writes the metadata's title as the svg's <title>
    return f'{head} id="{plot_id}" class="plot" role="img">{rest}'


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=72, layout="constrained")
    fig.set_facecolor("white")
    return fig


def _style(ax, *, xlabel: str, ylabel: str, title: str = "") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=11)
    ax.grid(True, axis="y", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


# ---- memory ---------------------------------------------------------------------------------


def _grouped_bars(ax, labels: list[str], planned: list[int], measured: list[int], size: int) -> None:
    """Two bars per category, side by side: the plan's and the measurement's (never stacked or
    overlaid, so equal values still read as two bars)."""
    width = 0.38
    xs = range(len(labels))
    ax.bar([x - width / 2 for x in xs], [p / size for p in planned], width, color=PLAN_COLOR, label="plan")
    ax.bar([x + width / 2 for x in xs], [m / size for m in measured], width, color=MEASURED_COLOR, label="measured")
    ax.set_xticks(list(xs), labels)
    ax.set_xlim(-0.6, len(labels) - 0.4)


def memory_svg(rows: list[dict]) -> str:
    """Per device: plan vs measured total in each phase of the run, and per component group in
    the measured step's peak phase; grouped bars. '' when there are no rows to draw."""
    devices: dict[str, dict[tuple[str, str], dict]] = {}
    for r in rows:
        if r["component"] == "total" or r["component"] in GROUPS:
            devices.setdefault(r["device"], {})[(r["phase"], r["component"])] = r
    if not devices:
        return ""
    largest = max(max(r["planned"], r["measured"]) for d in devices.values() for r in d.values())
    unit, size = byte_unit(largest)
    fig = _figure(11, 3.4 * len(devices))
    axes = fig.subplots(len(devices), 2, squeeze=False, gridspec_kw={"width_ratios": [3, 2]})
    for (device, cells), (by_phase, by_group) in zip(devices.items(), axes, strict=True):
        phases = list(dict.fromkeys(ph for ph, comp in cells if comp == "total"))
        totals = [cells[(ph, "total")] for ph in phases]
        _grouped_bars(by_phase, phases, [r["planned"] for r in totals], [r["measured"] for r in totals], size)
        _style(by_phase, xlabel="phase", ylabel=f"allocated ({unit})", title=f"{device}: total by phase")
        step = [ph for ph in phases if ph in STEP_PHASES]
        peak = max(step or phases, key=lambda ph: cells[(ph, "total")]["measured"])
        groups = [g for g in GROUPS if (peak, g) in cells]
        if groups:
            got = [cells[(peak, g)] for g in groups]
            _grouped_bars(by_group, groups, [r["planned"] for r in got], [r["measured"] for r in got], size)
            _style(by_group, xlabel="component group", ylabel=f"allocated ({unit})", title=f"by component, {peak}")
            _nice_axis(by_group.yaxis)
        else:
            by_group.set_visible(False)
        _nice_axis(by_phase.yaxis)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside upper center", ncols=2, frameon=False)
    return to_svg(fig, "plot-memory", "Memory per device: plan vs measured")


# ---- training history -----------------------------------------------------------------------


def held_out_points(record: dict, evals: list[dict]) -> list[tuple[int, float]]:
    """Held-out loss at every evaluation the run made: before training (step 0), each
    train.eval_every evaluation, and after the last step."""
    steps = record.get("steps") or []
    points = [(0, record["eval_before"]["loss"])] if record.get("eval_before") else []
    points += [(e["step"], e["loss"]) for e in evals]
    if record.get("eval_after") and steps:
        points.append((steps[-1]["step"], record["eval_after"]["loss"]))
    return [(x, y) for x, y in points if math.isfinite(y)]


def loss_svg(record: dict, evals: list[dict]) -> str:
    """Training loss and held-out loss over steps, and the learning rate below it."""
    steps = record.get("steps") or []
    if not steps:
        return ""
    fig = _figure(11, 6)
    ax, lr_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    xs = [s["step"] for s in steps]
    train = [(s["step"], s["loss"]) for s in steps if math.isfinite(s["loss"])]
    if train:  # a run whose every loss was non-finite still shows its held-out points
        ax.plot(*zip(*train, strict=True), color=TRAIN_COLOR, linewidth=1.8, label="training loss (per step)")
    held = held_out_points(record, evals)
    if held:
        # two evaluations are two points: a line between them would pretend to be a curve
        style = {"linestyle": "-" if len(held) > 2 else "none", "marker": "o", "markersize": 6}
        ax.plot(*zip(*held, strict=True), color=HELD_OUT_COLOR, label="held-out loss (evaluations)", **style)
    _style(ax, xlabel="", ylabel="loss (mean token cross-entropy, nats)", title="Loss")
    fig.legend(loc="outside upper center", ncols=2, frameon=False)
    lr = [s.get("lr") for s in steps]
    if all(v is not None for v in lr):
        lr_ax.plot(xs, lr, color=LR_COLOR, linewidth=1.8, drawstyle="steps-post")
        lr_ax.set_ylim(0, max(lr) * 1.15 or 1)
    _style(lr_ax, xlabel="optimizer step", ylabel="learning rate")
    for a in (ax, lr_ax):
        _nice_axis(a.xaxis, integer=True)
        _nice_axis(a.yaxis)
    ax.set_xlim((0 if held else min(xs)) - 0.5, max(xs) + 0.5)
    return to_svg(fig, "plot-loss", "Loss and learning rate over steps")


def series_svg(
    steps: list[dict], key: str, *, plot_id: str, title: str, ylabel: str, color: str, zero: bool = True
) -> str:
    """One per-step quantity (grad norm, tokens/s) over steps; '' when the record lacks it.
    Non-finite values (a skipped fp16 step's infinite grad norm) are left out. `zero`: the y axis
    starts at 0."""
    points = [(s["step"], s[key]) for s in steps if s.get(key) is not None and math.isfinite(s[key])]
    if not points:
        return ""
    fig = _figure(11, 3.2)
    ax = fig.subplots()
    ax.plot(*zip(*points, strict=True), color=color, linewidth=1.6, marker="o", markersize=3)
    if zero:
        ax.set_ylim(bottom=0)
    _style(ax, xlabel="optimizer step", ylabel=ylabel, title=title)
    _nice_axis(ax.xaxis, integer=True)
    _nice_axis(ax.yaxis)
    return to_svg(fig, plot_id, title)
