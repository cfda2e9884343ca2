"""Activation checkpointing as a continuum on the CPU: planned vs measured peak and step time for
none / the first N layers / every layer, selective (matmul outputs kept) or full, and the longest
sequence under a budget, planned vs run.

Run: .venv/bin/python bench/checkpointing.py [--write-doc]   (--write-doc rewrites its table in docs/benchmarks.md)
     .venv/bin/python bench/checkpointing.py --quick   (seq 64, two settings, two steps: that it runs)

The embedded default (SmolLM2-135M, 30 layers), LoRA as in the demo (fp32, r 8), micro-batch 2,
at seq 256 / 512 / 1024. Each row is a real run of 4 steps: the second step's peak is measured by
the storage tracker (every storage from creation to free), and the step time is the median of
steps 2-4. hardware.cpu_runtime_mib = 0, so the plan's bill is the allocated bytes the tracker
sees. The budget part: the longest seq (multiples of 256) whose plan fits hardware.memory_budget
without checkpointing, then both that seq and the next one run, and their measured peaks are
compared with the budget.
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import sys
import tempfile
from pathlib import Path

DOC = Path(__file__).parents[1] / "docs" / "benchmarks.md"
BEGIN, END = "<!-- checkpointing: begin -->", "<!-- checkpointing: end -->"
BASE = [
    "model.source=default",
    "mode=lora",
    "precision=fp32",
    "lora.r=8",
    "lora.alpha=16",
    "hardware.gpus=cpu",
    "hardware.cpu_runtime_mib=0",
    "batch.micro_batch_size=2",
    "train.steps=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "checkpoint.every=0",
]
SEQS = (256, 512, 1024)
# (memory.activation_checkpointing, memory.checkpointing_policy): of 30 layers
SETTINGS = (("false", "full"), ("10", "full"), ("20", "full"), ("true", "selective"), ("true", "full"))
BUDGET_MIB = 2048


def run(settings: list[str], out: Path) -> dict:
    from trainplan import config as C
    from trainplan.commands.train import execute
    from trainplan.plan import analytic

    cfg = C.load(None, [*BASE, *settings, f"train.output_dir={out}"])
    planned = analytic.plan(cfg).devices[0]
    record = execute(cfg, "off", quiet=True)[0]  # a measurement, not a run for the registry
    measured = record.memory["per_rank"][0]["peak_bytes"]
    seconds = statistics.median(s["seconds"] for s in record.steps[1:])
    return {"planned": planned.peak_allocated, "measured": measured, "seconds": seconds, "budget": planned.budget_bytes}


def longest_planned(budget: str) -> int:
    from trainplan import config as C
    from trainplan.plan import analytic

    seq = 256
    if not analytic.plan(C.load(None, [*BASE, f"batch.seq_len={seq}", f"hardware.memory_budget={budget}"])).fits:
        sys.exit(f"not even seq {seq} fits {budget}: raise BUDGET_MIB")
    while analytic.plan(C.load(None, [*BASE, f"batch.seq_len={seq + 256}", f"hardware.memory_budget={budget}"])).fits:
        seq += 256
    return seq


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-doc", action="store_true", help="rewrite the table in docs/benchmarks.md")
    ap.add_argument("--quick", action="store_true", help="seq 64, none and every layer, two steps; no budget rows")
    opts = ap.parse_args()
    if opts.quick and opts.write_doc:
        ap.error("--quick writes nothing: its rows are not the table's")
    seqs, settings = ((64,), (SETTINGS[0], SETTINGS[-1])) if opts.quick else (SEQS, SETTINGS)
    steps = ["train.steps=2"] if opts.quick else []
    lines = [
        "| seq | checkpointing | planned peak | measured peak | plan - measured | step time (median) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            for ac, policy in settings:
                sets = [*steps, f"batch.seq_len={seq}", f"memory.activation_checkpointing={ac}"]
                sets.append(f'memory.checkpointing_policy="{policy}"')
                r = run(sets, Path(tmp) / f"{seq}-{ac}-{policy}")
                what = {"false": "none", "true": "every layer (30)"}.get(ac, f"first {ac} of 30")
                what += ", selective" if policy == "selective" else ""
                err = (r["planned"] - r["measured"]) / r["measured"]
                cells = [str(seq), what, mib(r["planned"]), mib(r["measured"]), f"{err:+.2%}", f"{r['seconds']:.2f} s"]
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
        if opts.quick:
            return
        budget = f"{BUDGET_MIB}MiB"
        seq = longest_planned(budget)
        lines += [
            "",
            f"Budget {budget} (hardware.memory_budget), no checkpointing: the longest seq whose plan fits is "
            f"**{seq}**. Run at it and at the next step up:",
            "",
            "| seq | planned peak | measured peak | under the budget |",
            "|---:|---:|---:|---|",
        ]
        for s in (seq, seq + 256):
            r = run([f"batch.seq_len={s}", f"hardware.memory_budget={budget}"], Path(tmp) / f"budget-{s}")
            under = "yes" if r["measured"] <= r["budget"] else "no"
            lines.append(f"| {s} | {mib(r['planned'])} | {mib(r['measured'])} | {under} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if opts.write_doc:
        block = [
            BEGIN,
            f"Command: `.venv/bin/python bench/checkpointing.py --write-doc` ({datetime.date.today()}, the 2-core "
            "CPU machine; step times are noisy there, peaks are not).",
            "",
            *lines,
            END,
        ]
        text = DOC.read_text()
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), "\n".join(block), text, flags=re.S)
        else:
            text += "\n## Activation checkpointing as a continuum (CPU)\n\n" + "\n".join(block) + "\n"
        DOC.write_text(text)
        print(f"wrote {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
