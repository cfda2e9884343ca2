"""How fast is `trainplan advise`: candidate configurations planned per second.

Run: .venv/bin/python bench/advise_speed.py   (figures recorded in docs/advise.md)

Target (issue 8): a search over at least 1,000 candidate configurations finishes in under 2 s.
Every candidate is a full analytic `plan()`; the search time covers enumerating the ladder, planning
every rung at micro-batch 1 and binary-searching its largest micro-batch, and the step-time
estimates. Model loading (a preset's JSON) is outside it; the CLI wall time includes everything.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = [
    ("Llama-3.1-8B", "8xH100-80GB", 2048, 64),
    ("Llama-3.1-70B", "8xH100-80GB", 2048, 64),
    ("Qwen2.5-7B", "8xL4", 2048, 64),
    ("Llama-3.1-8B", "RTX4090", 2048, 16),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="searches per case (median reported)")
    opts = ap.parse_args()

    from trainplan import cli
    from trainplan.advise.command import request_from_args
    from trainplan.advise.search import search

    print(f"{'case':50s} {'rungs':>6s} {'candidates':>11s} {'fit':>5s} {'median s':>9s} {'ms/cand.':>9s}  target")
    for model, gpus, seq, batch in CASES:
        argv = ["advise", model, "--gpus", gpus, "--seq", str(seq), "--global-batch", str(batch)]
        request = request_from_args(cli.build_parser().parse_args(argv))
        seconds, result = [], None
        for _ in range(opts.repeat):
            t0 = time.perf_counter()
            result = search(request)
            seconds.append(time.perf_counter() - t0)
        med = statistics.median(seconds)
        n = result.evaluated
        fits = sum(o.fits for o in result.outcomes)
        verdict = ("met" if med < 2 else "MISSED") if n >= 1000 else "(< 1,000 candidates)"
        label = f"{model} on {gpus}, seq {seq}, batch {batch}"
        print(f"{label:50s} {len(result.outcomes):6d} {n:11,d} {fits:5d} {med:9.2f} {med / n * 1e3:9.2f}  {verdict}")

    model, gpus, seq, batch = CASES[0]
    argv = ["advise", model, "--gpus", gpus, "--seq", str(seq), "--global-batch", str(batch)]
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "trainplan", *argv], capture_output=True, check=True)
        walls.append(time.perf_counter() - t0)
    print(f"\nCLI wall, {model} on {gpus} (median of 3): {statistics.median(walls):.2f} s")


if __name__ == "__main__":
    main()
