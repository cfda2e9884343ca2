"""`trainplan trace`: the exact plan, the real model's step on fake tensors, beside the analytic one."""

from __future__ import annotations

import argparse
import json

from trainplan.commands import plan as plan_command
from trainplan.commands._common import config_from_args, emit
from trainplan.text import is_terminal

HELP = "the exact plan: run the real model step on fake tensors and compare it with the analytic ledger"


def add_args(p: argparse.ArgumentParser) -> None:
    plan_command.add_args(p)


def render_comparison(rows: list[dict]) -> str:
    from trainplan.plan.ledger import gib

    lines = [f"{'phase':10s} {'group':13s} {'analytic':>12s} {'traced':>12s} {'diff / traced peak':>19s}"]
    for row in rows:
        lines.append(
            f"{row['phase']:10s} {row['group']:13s} {gib(row['analytic']):>12s} {gib(row['traced']):>12s} "
            f"{row['diff_of_peak'] * 100:+18.2f}%"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from trainplan.plan.ledger import render_markdown, render_table

    ledger, comparison = traced_of(args)
    if args.json:
        emit(args, json.dumps({**ledger.to_json(), "comparison": comparison}, indent=1))
    else:
        body = render_markdown(ledger) if args.markdown else render_table(ledger, terminal=is_terminal(args.output))
        lines = [body, "", "Analytic vs traced (allocated bytes, per phase):", render_comparison(comparison["rows"])]
        emit(args, "\n".join([*lines, "", comparison["summary"]]))
    return ledger.exit_code_for(strict=args.strict)


def traced_of(args: argparse.Namespace) -> tuple:
    """(the traced ledger, its comparison with the analytic one) that `trainplan trace` prints for these
    arguments (`trainplan ui`'s trace button asks the same)."""
    from trainplan.plan import analytic, traced
    from trainplan.plan.ledger import gib

    result, resolved = traced.trace(config_from_args(args))
    analytic_ledger = analytic.plan(resolved.cfg, resolved.spec)
    ledger = traced.traced_ledger(result, resolved, analytic_ledger)
    rows = traced.compare(result, analytic_ledger)
    a_dev = analytic_ledger.devices[0]
    diff = 100 * (a_dev.peak_allocated - result.peak_bytes) / result.peak_bytes
    summary = (
        f"peak: analytic {gib(a_dev.peak_allocated)} ({a_dev.peak_phase}) vs traced {gib(result.peak_bytes)} "
        f"({result.peak_phase}): {diff:+.2f}% of traced; traced in {result.seconds:.1f} s, "
        f"max RSS {gib(result.max_rss_bytes)}"
    )
    comparison = {
        "rows": rows,
        "summary": summary,
        "row_sources": result.rows,
        "analytic_peak_bytes": a_dev.peak_allocated,
        "traced_peak_bytes": result.peak_bytes,
        "seconds": result.seconds,
        "max_rss_bytes": result.max_rss_bytes,
    }
    return ledger, comparison
