"""How fast is `trainplan advise`: candidate configurations planned per second.

Run: .venv/bin/python bench/advise_speed.py [--write-doc]   (--write-doc rewrites the table in docs/advise.md)
     .venv/bin/python bench/advise_speed.py --quick   (one search a case, one CLI run: that it runs)
     .venv/bin/python bench/advise_speed.py --against d8f10df [--cases 0,1,2]   (side by side with an
     older search, interleaved: per-round ratios; the machine's speed drifts by 2x over minutes)

Target (issue 22): the 70B search on 8 x A100 (>= 1,000 candidates) under 1.0 s median in-process
and under 1.5 s CLI wall, on the 2-core dev machine; every case under 1.0 s. Issue 67: the 70B
search on 8 x H100, cp and the long-context features in its ladder, under 1.5 s of CPU as a process. Every candidate is
planned (a check of the micro-batch binary search stops at the first device over). The search time
covers enumerating the ladder, planning every rung at micro-batch 1 and binary-searching its
largest micro-batch, the step-time estimates and, when nothing fits, the search for what would.
Model loading (a preset's JSON) is outside it; the CLI wall includes everything (interpreter
start, imports, printing). The machine's speed is printed beside the figures (a fixed Python loop).
tests/test_advise_snapshots.py runs these cases and holds their ranked lists byte for byte;
tests/test_advise.py checks the doc's counts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (model, devices, seq, global batch, mode)
CASES = [
    ("Llama-3.1-8B", "8xH100-80GB", 2048, 64, "auto"),
    ("Llama-3.1-70B", "8xA100-80GB", 2048, 64, "auto"),
    ("Qwen2.5-7B", "8xL4", 2048, 64, "auto"),
    ("Llama-3.1-405B", "8xH100-80GB", 2048, 8, "inference"),
]
CLI_CASE = 1  # the CLI wall is measured on the 70B case
CPU_CASE = ("Llama-3.1-70B", "8xH100-80GB", 2048, 64, "auto")  # issue 67: its CLI's CPU time under 1.5 s
TARGET_S, TARGET_CLI_S, TARGET_CLI_CPU_S, MIN_CANDIDATES = 1.0, 1.5, 1.5, 1000
DOC = Path(__file__).parents[1] / "docs" / "advise.md"
BEGIN, END = "<!-- advise_speed: begin -->", "<!-- advise_speed: end -->"


def argv(case: tuple) -> list[str]:
    model, gpus, seq, batch, mode = case
    return ["advise", model, "--gpus", gpus, "--seq", str(seq), "--global-batch", str(batch), "--mode", mode]


def argvs() -> list[list[str]]:
    return [argv(c) for c in CASES]


def machine_speed() -> float:
    """Seconds for a fixed pure-Python loop (10M additions): this machine's speed drifts by 2x over
    hours, so the table says how fast it was while measured."""
    t0, total = time.perf_counter(), 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - t0


def label(case: tuple) -> str:
    model, gpus, seq, batch, mode = case
    count, _, kind = gpus.partition("x")
    what = f"{model} {mode}" if mode != "auto" else model
    return f"{what} on {count} x {kind}, seq {seq}, batch {batch}"


# One side of --against: one case's search, 3 times in one process, as JSON seconds.
_SIDE = """
import json, sys, time
from trainplan import cli
from trainplan.commands.advise import request_from_args
from trainplan.advise.search import search
req = request_from_args(cli.build_parser().parse_args(json.loads(sys.argv[1])))
seconds = []
for _ in range(3):
    t0 = time.perf_counter()
    search(req)
    seconds.append(time.perf_counter() - t0)
print(json.dumps(seconds))
"""


def cli_seconds(case: tuple, runs: int = 5) -> tuple[float, float]:
    """Medians of `trainplan advise` as its own process: (wall seconds, CPU seconds: user + system)."""
    import resource

    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "trainplan", *argv(case)], capture_output=True, check=False)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def against(rev: str, rounds: int, case: int = CLI_CASE) -> str:
    """One case's search here and at `rev` (a git worktree in a temporary directory), alternating one
    process per side per round; the ratio of the two medians in each round, then their median."""
    import json
    import tempfile

    repo = Path(__file__).parents[1]
    argv_json = json.dumps([*argv(CASES[case]), "--registry", "off"])
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(other), rev], check=True)
        try:
            theirs, ours = [], []
            for _ in range(rounds):
                for root, acc in ((other, theirs), (repo, ours)):
                    out = subprocess.run(
                        [sys.executable, "-c", _SIDE, argv_json], cwd=root, capture_output=True, text=True, check=True
                    )
                    acc.append(statistics.median(json.loads(out.stdout)))
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(other)], check=False)
    ratios = [t / o for t, o in zip(theirs, ours, strict=True)]
    return (
        f"{label(CASES[case])}: {rev} median {statistics.median(theirs):.3f} s, this tree "
        f"{statistics.median(ours):.3f} s; per-round ratio median {statistics.median(ratios):.2f} "
        f"(n={rounds}, {min(ratios):.2f}-{max(ratios):.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="searches per case (median reported)")
    ap.add_argument("--write-doc", action="store_true", help="rewrite the table in docs/advise.md")
    ap.add_argument(
        "--against", metavar="REV", help="also time the 70B search at git revision REV, interleaved: per-round ratio"
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --against (each: one process per side)")
    ap.add_argument("--cases", default=str(CLI_CASE), help="--against: the cases' indices, comma-separated")
    ap.add_argument("--quick", action="store_true", help="one search per case and one CLI run: that it runs")
    opts = ap.parse_args()
    if opts.against:
        for case in map(int, opts.cases.split(",")):
            print(against(opts.against, opts.rounds, case), flush=True)
        return

    from trainplan import cli
    from trainplan.advise.search import search, what_would_fit
    from trainplan.commands.advise import request_from_args

    if opts.quick:
        if opts.write_doc:
            ap.error("--quick writes nothing: one search per case is not the table's median")
        opts.repeat = 1
    before = machine_speed()
    rows = []
    for case in CASES:
        request = request_from_args(cli.build_parser().parse_args([*argv(case), "--registry", "off"]))
        seconds = []
        for _ in range(opts.repeat):
            t0 = time.perf_counter()
            s = search(request)
            fits = sum(o.fits for o in s.outcomes)
            extra = 0 if fits else what_would_fit(s)[2]
            seconds.append(time.perf_counter() - t0)
        med, n = statistics.median(seconds), s.evaluated + extra
        verdict = "met" if med < TARGET_S else "MISSED"
        rows.append((label(case), len(s.outcomes), n, fits, med, min(seconds), max(seconds), verdict))
        print(
            f"{rows[-1][0]:62s} rungs {len(s.outcomes):4d}  candidates {n:6,d}  fit {fits:4d}  "
            f"median {med:.3f} s ({min(seconds):.3f}-{max(seconds):.3f})  {verdict}",
            flush=True,
        )

    runs = 1 if opts.quick else 5
    wall, _ = cli_seconds(CASES[CLI_CASE], runs)
    cli_verdict = "met" if wall < TARGET_CLI_S else "MISSED"
    print(f"\nCLI wall, {label(CASES[CLI_CASE])} (median of {runs}): {wall:.2f} s  {cli_verdict}")
    _, cpu = cli_seconds(CPU_CASE, runs)
    cpu_verdict = "met" if cpu < TARGET_CLI_CPU_S else "MISSED"
    print(f"CLI CPU (user + system), {label(CPU_CASE)} (median of {runs}): {cpu:.2f} s  {cpu_verdict}")

    speed = f"a 10M-iteration Python loop took {before:.2f} s before and {machine_speed():.2f} s after"
    print(f"machine: {speed}")
    if opts.write_doc:
        load = os.getloadavg()[0]
        lines = [
            BEGIN,
            f"Command: `.venv/bin/python bench/advise_speed.py --write-doc` ({datetime.date.today()}, "
            f"{os.cpu_count()} CPUs, load average {load:.1f} at the end, {speed}; median of {opts.repeat} searches "
            "each; every candidate is planned, a binary-search check up to the first device over its budget).",
            "",
            "| case | rungs | candidates planned | fit | search, median | range | per candidate | target 1.0 s |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name, rungs, n, fits, med, lo, hi, verdict in rows:
            lines.append(
                f"| {name} | {rungs} | {n:,} | {fits} | {med:.3f} s | {lo:.3f}-{hi:.3f} s | "
                f"{med / n * 1e3:.2f} ms | {verdict} |"
            )
        lines += [
            "",
            f"CLI wall time, everything included, for the {label(CASES[CLI_CASE])} case: **{wall:.2f} s** "
            f"(median of 5; target {TARGET_CLI_S} s: {cli_verdict}). CPU time (user + system), everything "
            f"included, for the {label(CPU_CASE)} case: **{cpu:.2f} s** (median of 5; target {TARGET_CLI_CPU_S} s, "
            f"issue 67: {cpu_verdict}).",
            END,
        ]
        text = DOC.read_text()
        new, count = re.subn(re.escape(BEGIN) + ".*?" + re.escape(END), "\n".join(lines), text, flags=re.S)
        if count != 1:
            sys.exit(f"{DOC}: the markers {BEGIN} ... {END} are missing")
        DOC.write_text(new)
        print(f"wrote the table in {DOC}")


if __name__ == "__main__":
    main()
