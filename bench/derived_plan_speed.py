"""Cold and warm `trainplan plan` wall time for architectures with derived terms (plan/derived.py).

Run: .venv/bin/python bench/derived_plan_speed.py [--warm 5]
     .venv/bin/python bench/derived_plan_speed.py --quick   (Qwen3-shaped LoRA only, one warm plan: that it runs)

Cold: an empty derived-terms cache, so the plan traces 1- and 2-layer models at four points.
Warm: the cache filled; the goal is < 0.5 s for the whole `trainplan plan` process (imports
included), which holds only if a warm plan imports no torch. Recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def configs(tmp: Path) -> dict[str, Path]:
    import transformers

    shapes = {
        "Qwen3 (0.6B-shaped)": transformers.Qwen3Config(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        ),
        "Gemma-3 (Gemma3TextConfig defaults)": transformers.Gemma3TextConfig(),
    }
    out = {}
    for i, (name, hf) in enumerate(shapes.items()):
        path = tmp / f"model{i}.json"
        path.write_text(json.dumps(hf.to_dict()))
        out[name] = path
    return out


def timed(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainplan", *argv], env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(proc.stderr)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the first model, LoRA only, one warm plan")
    args = ap.parse_args()
    if args.quick:
        args.warm = 1
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TRAINPLAN_CACHE": str(Path(tmp) / "cache")}
        print(f"| model | mode | cold s | warm s (median of {args.warm}) |")
        print("|---|---|---:|---:|")
        models = list(configs(Path(tmp)).items())
        for name, path in models[:1] if args.quick else models:
            for mode in ("lora",) if args.quick else ("lora", "full"):
                argv = ["plan", "--model", str(path), "--mode", mode, "--gpus", "H100-80GB", "--json"]
                cold = timed(argv, env)
                warm = statistics.median(timed(argv, env) for _ in range(args.warm))
                print(f"| {name} | {mode} | {cold:.1f} | {warm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
