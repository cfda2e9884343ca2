"""The longest context that fits (issue 67): a tiny model under a memory cap on this CPU, each long-context feature
on and off, and the advisor's real-size answers beside the field's published figures.

Part 1, this machine: tiny-llama (2 layers, hidden 64, intermediate 160) on the CPU with hardware.memory_budget as
the cap, full fine-tuning in fp32, micro-batch 1. For each setting, the longest sequence (a multiple of 1,024) whose
plan fits, found by bisection over the analytic plan, and at that length the fake-tensor trace of the engine's own
step (`trainplan trace`), whose peak must stay under the cap too. Eager attention stands for the (s x s) mask that
document packing used to build; "cp 2" is two CPU ranks, each under the cap.

Part 2, the advisor: `advise --maximize seq` for Llama-3.1-8B with model.extend_context and 2 TiB of host RAM, the
first row (one `trainplan train` runs), beside DeepSpeed ALST's, TRL's and torchtitan's published runs.

    python bench/long_context.py            # both parts (about a minute)
    python bench/long_context.py --quick    # a smaller cap, fewer settings, one advisor row (the suite runs it)
"""

from __future__ import annotations

import argparse
import sys
import time

from trainplan import config as C
from trainplan.plan import analytic, traced

STEP = 1024
TINY = ["model.source=tiny-llama", "precision=fp32", "batch.micro_batch_size=1", "model.extend_context=true"]
TINY += ["hardware.cpu_runtime_mib=0"]  # the cap bills tensors: the process's own runtime is not the question
SETTINGS = [  # (name, settings, gpus)
    ("eager attention (an s x s mask per layer)", ["memory.attention=eager"], "cpu"),
    ("SDPA, packed documents (no mask)", ["data.packing=document"], "cpu"),
    ("+ activation checkpointing", ["data.packing=document", "memory.activation_checkpointing=true"], "cpu"),
    (
        "+ tiled MLP",
        ["data.packing=document", "memory.activation_checkpointing=true", "memory.tiled_mlp=true"],
        "cpu",
    ),
    (
        "+ cp 2 (each of 2 ranks under the cap)",
        ["data.packing=document", "memory.activation_checkpointing=true", "memory.tiled_mlp=true", "parallel.cp=2"],
        "2xcpu",
    ),
]
QUICK = (1, 3)
# the field's published runs, each with its source (FIELD.md)
PUBLISHED = [
    ("Llama-3.1-8B", "1xH100-80GB", "full", 500_000, "DeepSpeed ALST (arXiv 2506.13996)"),
    ("Llama-3.1-8B", "1xH100-80GB", "lora", None, "-"),
    ("Llama-3.1-8B", "8xH100-80GB", "full", 3_700_000, "DeepSpeed ALST (arXiv 2506.13996)"),
    ("Llama-3.1-8B", "8xH100-80GB", "full", 262_144, "torchtitan, CP 8 (benchmarks/llama3_h100_202412)"),
    ("Qwen3-8B", "8xH100-80GB", "full", 1_000_000, "TRL sft_qwen3_8b_1m_context, cp 8 (Qwen3-8B)"),
]


def _config(sets: list[str], gpus: str, cap: str, seq: int) -> C.RunConfig:
    return C.load(
        None, [*TINY, *sets, f"hardware.gpus={gpus}", f"hardware.memory_budget={cap}", f"batch.seq_len={seq}"]
    )


def longest(sets: list[str], gpus: str, cap: str, limit: int) -> tuple[int, int]:
    """(the longest multiple of STEP whose plan fits, its planned peak), by bisection."""
    lo, hi = 0, limit // STEP + 1  # lo fits (0: nothing), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if analytic.plan(_config(sets, gpus, cap, mid * STEP)).fits:
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return 0, 0
    ledger = analytic.plan(_config(sets, gpus, cap, lo * STEP))
    return lo * STEP, max(d.peak_allocated for d in ledger.devices)


def part_one(cap: str, limit: int, rows: list[int]) -> list[dict]:
    out = []
    for i in rows:
        name, sets, gpus = SETTINGS[i]
        t0 = time.perf_counter()
        seq, planned = longest(sets, gpus, cap, limit)
        trace_peak = traced.trace(_config(sets, gpus, cap, seq))[0].peak_bytes if seq else 0
        out.append(
            {"setting": name, "seq": seq, "planned": planned, "traced": trace_peak, "s": time.perf_counter() - t0}
        )
    return out


def part_two(rows) -> list[dict]:
    from trainplan import cli
    from trainplan.advise import maximize as M
    from trainplan.advise.rank import rung_blocker
    from trainplan.commands.advise import request_from_args

    out = []
    for model, gpus, mode, field, source in rows:
        argv = ["advise", f"meta-llama/{model}" if model.startswith("Llama") else model, "--maximize", "seq"]
        argv += ["--gpus", gpus, "--mode", mode, "--set", "model.extend_context=true"]
        argv += ["--set", "hardware.host_mem=2TiB", "--registry", "off"]
        if model == "Qwen3-8B":
            argv[1] = "Qwen3-8B"
        req = request_from_args(cli.build_parser("advise").parse_args(argv))
        t0 = time.perf_counter()
        m = M.maximize(req, "seq")
        runs = [x for x in m.ranked if not rung_blocker(x.config, x.rung, req.spec, m.devices)]
        first = runs[0] if runs else None
        out.append(
            {
                "model": model,
                "gpus": gpus,
                "mode": mode,
                "trainplan": first.value if first else 0,
                "rung": first.rung.short() if first else "nothing fits",
                "field": field,
                "source": source,
                "s": time.perf_counter() - t0,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller cap, fewer settings, one advisor row")
    args = p.parse_args(argv)
    cap, limit = ("24MiB", 1 << 15) if args.quick else ("512MiB", 1 << 20)
    one = part_one(cap, limit, list(QUICK) if args.quick else list(range(len(SETTINGS))))
    print(f"Part 1: tiny-llama on this CPU, full fine-tuning, fp32, the longest sequence under {cap} a device")
    print(f"{'setting':48} {'longest seq':>12} {'planned peak':>13} {'traced peak':>12}")
    for row in one:
        print(
            f"{row['setting']:48} {row['seq']:>12,} {row['planned'] / 2**20:>10.1f} MiB "
            f"{row['traced'] / 2**20:>8.1f} MiB"
        )
    from trainplan.spec.devices import parse_size

    # eager attention is the reference row: its plan is under its trace at these lengths (the s x s moments)
    bad = [r for r in one if r["traced"] > parse_size(cap, "hardware.memory_budget") and "eager" not in r["setting"]]
    two = part_two(PUBLISHED[1:2] if args.quick else PUBLISHED)
    print("\nPart 2: advise --maximize seq (model.extend_context, 2 TiB host RAM): row 1 that `trainplan train` runs")
    print(f"{'model':14} {'gpus':12} {'mode':5} {'trainplan':>10} {'published':>10}  source / trainplan's rung")
    for row in two:
        published = f"{row['field']:,}" if row["field"] else "-"
        print(
            f"{row['model']:14} {row['gpus']:12} {row['mode']:5} {row['trainplan']:>10,} {published:>10}  "
            f"{row['source']}"
        )
        print(f"{'':44}  {row['rung']}")
    if bad:
        print(f"traced peak over the cap: {[r['setting'] for r in bad]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
