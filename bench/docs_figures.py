"""Rerun the figures the README and docs quote, and write them back with the date and the machine.

Run: .venv/bin/python bench/docs_figures.py [--only demo,advise,checkpointing]   (make docs-figures)
     .venv/bin/python bench/docs_figures.py --quick   (runs and writes nothing: the markers and flags it needs)

- demo: `make demo`'s acceptance run (`trainplan accept --output-dir runs/accept`) and the full
  fine-tune example (`trainplan train examples/demo-full.toml`): the verdict block and the table of both
  runs in README.md, between its `docs_figures: demo` markers; the LoRA result's model card in
  docs/result-card.md.
- advise: docs/advise.md's search-speed table (bench/advise_speed.py --write-doc).
- checkpointing: docs/benchmarks.md's checkpointing table (bench/checkpointing.py --write-doc).

Each figure is what the command printed or recorded, never edited by hand; a figure that cannot be
rerun (a GPU's) lives in docs/gpu-validation.md with its own command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CARD = ROOT / "docs" / "result-card.md"  # the model card the demo's LoRA run writes, as written
BEGIN, END = "<!-- docs_figures: demo begin -->", "<!-- docs_figures: demo end -->"
TRAINPLAN = [sys.executable, "-m", "trainplan"]


def machine() -> str:
    """The CPU model and core count, from /proc/cpuinfo where there is one."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {model}"


def _run(cmd: list[str]) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout, time.perf_counter() - t0


def _row(what: str, config: str, record: dict, wall: float) -> str:
    before, after, b = record["eval_before"], record["eval_after"], record["batch"]
    steps = len(record["steps"])
    return (
        f"| {what} | `{config}` | {steps} x {b['global']} x {b['seq_len']} | {before['loss']:.3f} -> "
        f"{after['loss']:.3f} | {before['perplexity']:.2f} -> {after['perplexity']:.2f} | "
        f"{before['token_accuracy']:.3f} -> {after['token_accuracy']:.3f} | {record['train_seconds']:.0f} s "
        f"({wall:.0f} s wall) |"
    )


def demo() -> str:
    """The README's demo block: accept's verdict, then the table of the LoRA and the full run."""
    verdict, accept_wall = _run([*TRAINPLAN, "accept", "--output-dir", "runs/accept"])
    accept = json.loads((ROOT / "runs/accept/train/record.json").read_text())
    _, full_wall = _run([*TRAINPLAN, "train", "examples/demo-full.toml", "--quiet"])
    full = json.loads((ROOT / "runs/demo-full/record.json").read_text())
    lora = accept["config"]["lora"]
    card = Path(accept["result"]["path"]) / "README.md"
    CARD.write_text(
        "# The model card of the README's run\n\n`trainplan accept` (the README's `make demo`) trains a LoRA "
        f"adapter on the embedded default; its result directory holds this README.md, written from the run's record "
        f"(run/result.py `write_card`). Measured on {machine()}, {datetime.date.today()}, `make docs-figures`; "
        "copied as written:\n\n````markdown\n" + card.read_text() + "````\n"
    )
    lines = [
        f"Measured on this machine ({machine()}, {datetime.date.today()}, `make docs-figures`):",
        "",
        "```",
        verdict.strip(),
        "```",
        "",
        "| run | config | steps x sequences x tokens | held-out loss | perplexity | token accuracy | train time |",
        "|---|---|---|---|---|---|---|",
        _row(
            f"LoRA r={lora['r']} on {','.join(t.replace('_proj', '') for t in lora['target_modules'])}",
            "trainplan accept",
            accept,
            accept_wall,
        ),
        _row("full fine-tune", "examples/demo-full.toml", full, full_wall),
    ]
    return "\n".join(lines)


def write_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`text` with what lies between the markers replaced by `block`; the markers must be there once."""
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"README.md must hold {begin} and {end} once each")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{begin}\n{block}\n{end}", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="demo,advise,checkpointing", help="comma-separated: demo, advise, checkpointing")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="run nothing, write nothing: the README's markers are there once and each script it delegates to takes "
        "--write-doc (the runs themselves are those scripts' own --quick)",
    )
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.quick:
        write_block(README.read_text(), "")
        for name in ("advise_speed", "checkpointing"):
            usage = _run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--help"])[0]
            if "--write-doc" not in usage:
                sys.exit(f"bench/{name}.py no longer takes --write-doc")
        print("README.md holds the demo markers once; advise_speed.py and checkpointing.py take --write-doc")
        return
    if "demo" in only:
        README.write_text(write_block(README.read_text(), demo()))
        print("README.md: the demo block rewritten")
    for name in ("advise_speed", "checkpointing"):
        if name.split("_")[0] in only:
            subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--write-doc"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
