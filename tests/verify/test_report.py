"""The acceptance report from a synthetic but realistic accept result (no training run): its
plots are matplotlib SVG with round tick labels, the Run section is a table, and one duration."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest

from trainplan import config as C
from trainplan.verify import accept, plots, report

GiB = 1 << 30
SVG = "{http://www.w3.org/2000/svg}"


def _eval(loss: float, tokens: int = 8192) -> dict:
    return {"loss": loss, "perplexity": math.exp(loss), "token_accuracy": 0.45 + (2.9 - loss) / 4, "tokens": tokens}


def _rows() -> list[dict]:
    """One CPU device: phase totals, and component groups in the step phases (SmolLM2-135M LoRA-sized)."""
    planned = {
        ("load", "total"): 0.5,
        ("forward", "states"): 0.503,
        ("forward", "activations+"): 1.31,
        ("forward", "total"): 1.813,
        ("backward", "states"): 0.503,
        ("backward", "gradients"): 0.0021,
        ("backward", "activations+"): 1.42,
        ("backward", "total"): 1.925,
        ("optimizer", "states"): 0.503,
        ("optimizer", "optimizer"): 0.0,  # a zero planned value: no percentage of it
        ("optimizer", "total"): 0.506,
        ("evaluate", "total"): 0.71,
        ("save", "total"): 0.51,
    }
    rows = []
    for (phase, comp), gib in planned.items():
        p = int(gib * GiB)
        m = p if comp == "states" else int(p * 1.01) + (1 << 20 if p == 0 else 0)
        rows.append(
            {
                "device": "rank 0 (cpu)",
                "phase": phase,
                "component": comp,
                "components": [],
                "planned": p,
                "measured": m,
                "abs_error": p - m,
                "rel_error": (p - m) / m if m else None,
                "error_of_peak": (p - m) / (1.95 * GiB),
                "ok": True,
            }
        )
    return rows


@pytest.fixture(scope="module")
def result() -> dict:
    return accept_result()


def accept_result() -> dict:
    """An accept result as accept.accept returns it: 20 LoRA steps with warmup, held-out loss every
    5 steps, the memory rows of one device, and before/after generations."""
    sets = ["train.warmup_steps=4", "train.schedule=cosine", "train.eval_every=5", 'lora.target_modules=["attention"]']
    cfg = C.load(accept.DEFAULT_CONFIG, sets).to_dict()
    steps = []
    for i in range(1, 21):
        lr = 1e-3 * min(1.0, i / 4) * (0.5 * (1 + math.cos(math.pi * max(0, i - 4) / 16)))
        entry = {
            "step": i,
            "loss": 2.9 - 0.35 * (1 - math.exp(-i / 6)) + 0.03 * math.sin(i),
            "grad_norm": 0.8 + 0.3 * math.exp(-i / 5),
            "lr": lr,
            "tokens": 1020,
            "tokens_per_s": 310 + 15 * math.sin(i / 2),
            "seconds": 3.3,
            "memory": {"max_rss_bytes": int(3.7 * GiB)},
        }
        if i % 5 == 0 and i < 20:
            entry["eval"] = _eval(2.81 - 0.018 * i)
        steps.append(entry)
    record = {
        "schema": "trainplan.run/1",
        "config": cfg,
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0", "peft": "0.21.2"},
        "hardware": {"device": "cpu", "world_size": 1, "devices": "cpu"},
        "seed": 0,
        "data": {
            "source": "stdlib-docs",
            "fingerprint": "1f2e3d4c5b6a7988",
            "train_documents": 480,
            "eval_documents": 24,
            "train_sequences": 5100,
            "eval_sequences": 260,
        },
        "model": {
            "name": "SmolLM2-135M-Instruct (embedded default)",
            "model_type": "llama",
            "params": 134515008,
            "layers": 30,
            "hidden": 576,
            "heads": 9,
            "kv_heads": 3,
            "vocab": 49152,
        },
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1, "global": 4, "seq_len": 256},
        "steps": steps,
        "eval_before": _eval(2.812),
        "eval_after": _eval(2.536),
        "wall_seconds": 147.2,
        "train_seconds": 75.4,
        "samples": [
            {"prompt": "def fibonacci(n):", "before": "\n    pass", "after": "\n    if n < 2:\n        return n"}
        ],
    }
    evals = [{"step": s["step"], **s["eval"]} for s in steps if "eval" in s]
    checks = [
        {"key": "contract", "name": "Mode contract", "passed": True, "summary": "lora: base unchanged", "evidence": {}},
        {
            "key": "memory",
            "name": "Memory, plan vs measured per device",
            "passed": True,
            "summary": "all rows within ±5%",
            "evidence": {
                "tolerance": 0.05,
                "measured_step": 2,
                "rows": _rows(),
                "placement": [{"cpu": {"parameters": 134515008, "bytes": int(0.5 * GiB), "sharded": 0}}],
                "max_rss_bytes": [int(3.7 * GiB)],
            },
        },
        {
            "key": "step",
            "name": "Training step",
            "passed": True,
            "summary": "finite",
            "evidence": {"overfit_losses": [2.9, 2.5, 2.1, 1.7, 1.4, 1.1]},
        },
        {
            "key": "quality",
            "name": "Quality (held-out)",
            "passed": True,
            "summary": "held-out loss 2.8120 -> 2.5360",
            "evidence": {"metric": "held-out mean token cross-entropy", "before": _eval(2.812), "after": _eval(2.536)}
            | {"evals": evals},
        },
        {"key": "resume", "name": "Resume", "passed": True, "summary": "bitwise equal", "evidence": {}},
        {"key": "instability", "name": "Instability scan", "passed": True, "summary": "no event", "evidence": {}},
    ]
    summary = "lora, fp32, micro-batch 4 x accum 1 x dp 1 = global 4, seq 256, world 1, dp 1 (single), sdpa attention"
    return {
        "verdict": "PASS",
        "failing": [],
        "checks": checks,
        "order": [c["key"] for c in checks],
        "plan": {
            "settings": {
                "summary": summary,
                "parallel": "world 1, dp 1 (single)",
                "lora": {"target_modules": ["q_proj", "v_proj"]},
            }
        },
        "perturbed": {},
        "record": record,
        "memory": None,
        "device_name": "cpu",
        "seconds": 257.0,
    }


@pytest.fixture(scope="module")
def page(result) -> str:
    return report.render_html(result)


def svgs(page: str) -> dict[str, ET.Element]:
    """The page's inline SVG plots by id, parsed."""
    found = re.findall(r"<svg\b.*?</svg>", page, re.S)
    trees = [ET.fromstring(s) for s in found]
    return {t.get("id"): t for t in trees}


def tick_labels(svg: ET.Element, axis: str) -> list[list[str]]:
    """Per axes of the plot, the text of its x or y tick labels (matplotlib's xtick_N / ytick_N groups)."""
    out = []
    for axes in svg.iter(f"{SVG}g"):
        if not re.fullmatch(r"plot-[\w-]+-axes_\d+", axes.get("id", "")):
            continue
        labels = [
            "".join(t.itertext()).strip()
            for g in axes.iter(f"{SVG}g")
            if re.fullmatch(rf"plot-[\w-]+-{axis}tick_\d+", g.get("id", ""))
            for t in g.iter(f"{SVG}text")
        ]
        if labels:
            out.append(labels)
    return out


def is_round_scale(labels: list[str]) -> bool:
    """Evenly spaced ticks at 1, 2, 2.5 or 5 x 10^k, each a multiple of that spacing."""
    values = [float(x.replace("\u2212", "-")) for x in labels]
    if len(values) < 2:
        return False
    spacing = values[1] - values[0]
    if spacing <= 0 or any(
        not math.isclose(b - a, spacing, rel_tol=1e-6) for a, b in zip(values, values[1:], strict=False)
    ):
        return False
    mantissa = spacing / 10 ** math.floor(math.log10(spacing))
    if not any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5, 10)):
        return False
    return all(math.isclose(v / spacing, round(v / spacing), abs_tol=1e-6) for v in values)


def test_round_scale_check_refuses_hand_drawn_ticks():
    assert is_round_scale(["0", "0.5", "1.0", "1.5"]) and is_round_scale(["0", "25", "50", "75"])
    assert not is_round_scale(["0.48", "0.95", "1.43"]) and not is_round_scale(["5.75", "10.5", "15.25"])
    assert not is_round_scale(["0.1", "0.3", "0.5"][:1])


def test_tick_text_writes_each_axis_with_the_decimals_it_needs():
    assert [plots.tick_text(v, plots.decimals([0, 0.2, 0.4])) for v in (0, 0.2, 0.4)] == ["0.0", "0.2", "0.4"]
    assert plots.decimals([0, 2.5, 5, 7.5]) == 1 and plots.decimals([0, 0.0002, 0.0004]) == 4
    assert plots.tick_text(-0.0, 1) == "0.0" and plots.decimals([10, 20, 30]) == 0


def test_every_plot_is_present_with_round_ticks_and_units(page):
    plots_by_id = svgs(page)
    assert set(plots_by_id) == {"plot-memory", "plot-loss", "plot-grad-norm", "plot-throughput", "plot-overfit"}
    titles = {k: v.find(f"{SVG}title").text for k, v in plots_by_id.items()}
    assert titles["plot-memory"] == "Memory per device: plan vs measured"
    assert titles["plot-loss"] == "Loss and learning rate over steps"
    for plot_id, svg in plots_by_id.items():
        ys = tick_labels(svg, "y")
        assert ys, plot_id
        for labels in ys:
            assert is_round_scale(labels), (plot_id, labels)
        if plot_id != "plot-memory":  # the memory plot's x axis names phases and components
            for labels in tick_labels(svg, "x"):
                assert is_round_scale(labels), (plot_id, labels)
    texts = {"".join(t.itertext()) for svg in plots_by_id.values() for t in svg.iter(f"{SVG}text")}
    assert {"allocated (GiB)", "learning rate", "tokens/s (target tokens)", "optimizer step"} <= texts
    assert {"plan", "measured", "held-out loss (evaluations)"} <= texts


def test_memory_bars_are_two_per_category_never_one_hiding_the_other(page):
    svg = svgs(page)["plot-memory"]
    fills = [p.get("style", "") for p in svg.iter(f"{SVG}path")]
    plan = sum(plots.PLAN_COLOR in s for s in fills)
    measured = sum(plots.MEASURED_COLOR in s for s in fills)
    # 6 phases + 4 groups at the backward peak, each a plan and a measured bar (+1 legend patch each)
    assert plan == measured == 6 + 3 + 1


def _held_out_line(svg: ET.Element) -> int:
    """Stroked paths in the held-out colour: the line through the evaluations (markers are <use>)."""
    return sum(
        f"stroke: {plots.HELD_OUT_COLOR}" in p.get("style", "") and "fill: none" in p.get("style", "")
        for p in svg.iter(f"{SVG}path")
    )


def test_held_out_loss_has_a_point_per_evaluation_and_no_line_between_two(result, page):
    points = plots.held_out_points(result["record"], result["checks"][3]["evidence"]["evals"])
    assert [x for x, _ in points] == [0, 5, 10, 15, 20]
    assert _held_out_line(svgs(page)["plot-loss"]) == 2  # the curve, and its legend handle
    two = dict(result["record"], steps=[{k: v for k, v in s.items() if k != "eval"} for s in result["record"]["steps"]])
    assert len(plots.held_out_points(two, [])) == 2
    svg = ET.fromstring(plots.loss_svg(two, []))
    assert _held_out_line(svg) == 0  # before and after: two markers, not a line pretending to be a curve
    markers = [u for u in svg.iter(f"{SVG}use") if plots.HELD_OUT_COLOR in (u.get("style") or "")]
    assert len(markers) in (2, 3)  # two points (and the legend's marker)


def test_run_section_is_a_table_and_one_duration_is_shown(result, page):
    text = report.render_markdown(result)
    assert "mode lora, lora" not in text and "lora, fp32," in text
    assert "run wall time 2m27s" in text and "run wall time 2m27s" in page
    assert "257 s" not in text and "257 s" not in page  # accept's own total is not a second duration
    assert '{"' not in text and "<pre>" not in page  # no JSON dump
    assert "<h2>Run</h2><table class='run'>" in page
    for fact in (
        "r 8, alpha 16, dropout 0.05 on attention (q_proj, v_proj)",
        "every 5 steps",
        "134.5M",
        "1f2e3d4c5b6a7988",
    ):
        assert fact in page
    zero = next(line for line in text.splitlines() if "| optimizer | optimizer |" in line)
    assert zero.split("|")[7].strip() == "—"  # rel error of a zero planned value: no percentage
    assert "## Generations before/after" in text and "<h2>Generations before/after</h2>" in page
    assert "fibonacci" in page


@pytest.mark.multiprocess
def test_the_page_renders_its_plots_in_a_headless_browser(page, tmp_path, screenshot):
    """Screenshot the page: both bar colours and the held-out markers are on screen."""
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:|//)", page), "the page must be self-contained"
    (tmp_path / "accept.html").write_text(page)
    counts = screenshot(tmp_path / "accept.html", 3600)

    def pixels(hex_color: str) -> int:
        return counts.get(tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5)), 0)

    assert pixels(plots.PLAN_COLOR) > 3000 and pixels(plots.MEASURED_COLOR) > 3000
    assert pixels(plots.HELD_OUT_COLOR) > 200 and pixels(plots.LR_COLOR) > 200
    assert pixels("#1a7f37") > 50  # the verdict heading in its colour
