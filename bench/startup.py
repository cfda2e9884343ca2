"""How long does `trainplan train` take to reach its first step, against a bare `import torch`?

Run: .venv/bin/python bench/startup.py [--repeat 5]   (figures recorded in docs/benchmarks.md)
     .venv/bin/python bench/startup.py --quick   (one round, no warm-up, no breakdown: that it runs)

Target (issue 47): a tiny-model run reaches step 1 within 2.0x the time a bare `python -c "import
torch"` takes, in the same run of this script. Both are fresh processes, timed from their start:
- the bare process exits after `import torch`;
- the train process is the CLI itself (`trainplan train` on a tiny random-init model, the embedded
  default tokenizer, six pydoc documents), with `trainplan.run.step.train_step` wrapped so that the
  process writes the time and exits the moment step 1 begins. Nothing else differs from a user's run.
trainplan's modules are compiled to bytecode first, as `make bench` / `make test` do and as Python does on
a first import where PYTHONDONTWRITEBYTECODE is not set (it is on these machines; without the cache each
process compiles trainplan's ~90 modules again, 0.1-0.15 s).
Then one more train process under `python -X importtime`: the modules it imports, by top-level
package, and the stages it spends its time in before step 1 (each stage's own progress line, -v).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,  # the embedded default tokenizer's
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}

# the child: the CLI as a user runs it (its process entry, as the `trainplan` script and `python -m
# trainplan` call it), stopped at the start of step 1
CHILD = """
import os, sys, time
from trainplan.run import step
def first_step(*args, **kwargs):
    with open(os.environ["STARTUP_MARK"], "w") as f:
        f.write(repr(time.time()))
    os._exit(0)
step.train_step = first_step
from trainplan.cli import entry
sys.exit(entry())
"""


def setup(root: Path) -> list[str]:
    import pydoc_data.topics as topics

    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    corpus = root / "corpus"
    corpus.mkdir()
    for name in sorted(topics.topics)[:6]:
        (corpus / f"{name}.txt").write_text(topics.topics[name][:6000])
    settings = [
        f"model.source={root / 'model' / 'config.json'}",
        "model.init=random",
        f"data.source={corpus}",
        "data.eval_fraction=0.34",
        "batch.seq_len=32",
        "batch.micro_batch_size=4",
        "train.steps=3",
        "train.eval_batches=2",
        "train.report_to=none",
        "precision=fp32",
    ]
    return ["train", *(a for s in settings for a in ("--set", s)), "--registry", "off", "-q"]


def bare(code: str) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.time() - t0


BARE_TORCH = "import torch"
# the floor under any run of a transformers model: torch, and the model's own module as transformers
# imports it (it pulls torch.distributed.tensor and torch._dynamo in)
BARE_MODEL = "import torch; from transformers.models.llama import modeling_llama"


def to_first_step(argv: list[str], root: Path, i: int) -> float:
    mark = root / f"mark-{i}"
    env = {**os.environ, "STARTUP_MARK": str(mark)}
    t0 = time.time()
    run = subprocess.run(
        [sys.executable, "-c", CHILD, *argv, "--output-dir", str(root / f"run-{i}")],
        env=env,
        capture_output=True,
        text=True,
    )
    if not mark.exists():
        raise SystemExit(f"the run never reached step 1 (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return float(mark.read_text()) - t0


def breakdown(argv: list[str], root: Path) -> tuple[dict[str, float], list[str]]:
    """Seconds of imports by top-level package, and the stage lines before step 1."""
    env = {**os.environ, "STARTUP_MARK": str(root / "mark-x")}
    argv = [a for a in argv if a != "-q"] + ["-v", "--output-dir", str(root / "run-x")]
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", CHILD, *argv], env=env, capture_output=True, text=True
    )
    packages: dict[str, float] = {}
    stages = []
    for line in run.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \| (\s*)(\S+)", line)
        if m:
            top = m.group(3).split(".")[0]
            packages[top] = packages.get(top, 0.0) + int(m.group(1)) / 1e6
        elif " done in " in line:
            stages.append(line.split(" ", 2)[-1])
    return packages, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one round, no warm-up run and no import breakdown")
    args = ap.parse_args()
    if args.quick:
        args.repeat = 1
    compileall.compile_dir(Path(__file__).resolve().parents[1] / "trainplan", quiet=1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        argv = setup(root)
        if not args.quick:
            to_first_step(argv, root, -1)  # warm: the tokenizer's one-time conversion, the page cache
        torch_s, model_s, train_s = [], [], []
        for i in range(args.repeat):  # interleaved: a busy moment costs every side
            torch_s.append(bare(BARE_TORCH))
            model_s.append(bare(BARE_MODEL))
            train_s.append(to_first_step(argv, root, i))
        torch_m, model_m, first = (statistics.median(x) for x in (torch_s, model_s, train_s))

        def row(label: str, median: float, times: list[float]) -> None:
            print(f"{label:<44} median {median:5.2f} s  ({', '.join(f'{t:.2f}' for t in times)})")

        row("bare `import torch`", torch_m, torch_s)
        row("bare torch + transformers' Llama module", model_m, model_s)
        row("`trainplan train` to step 1", first, train_s)
        print(f"ratio to import torch: {first / torch_m:.2f}x  (target <= 2.0x)")
        print(
            f"ratio to the floor (torch + the model's module): {first / model_m:.2f}x "
            f"(the floor itself: {model_m / torch_m:.2f}x import torch)"
        )
        if args.quick:
            return
        packages, stages = breakdown(argv, root)
        total = sum(packages.values())
        print(f"\nimports before step 1: {total:.2f} s, by top-level package (self time, > 0.05 s):")
        for name, s in sorted(packages.items(), key=lambda kv: -kv[1]):
            if s > 0.05:
                print(f"  {name:<24} {s:5.2f} s")
        print("\nstages before step 1 (-v):")
        for line in stages:
            print(f"  {line}")


if __name__ == "__main__":
    main()
