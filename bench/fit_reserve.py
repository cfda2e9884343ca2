"""Fit the analytic plan's allocator reserve per workload class from measured GPU runs.

Run: .venv/bin/python bench/fit_reserve.py docs/data/gpu-validate-h200-2026-12-04*.json \
        --replays docs/data/reserved-replay-h200-2026-12-04.json --out trainplan/plan/fragmentation.json
     .venv/bin/python bench/fit_reserve.py --quick   (those files, nothing written: that it runs)

The CUDA caching allocator reserves more than the tensors hold: blocks cached after a free, split
remainders, segments rounded up (c10/cuda/CUDACachingAllocator.cpp). A row's fragmentation is
(max_memory_reserved - max_memory_allocated) / max_memory_allocated, both measured on the same step,
so the plan's own error (the accuracy band) is not in it. A class's factor is the worst row of that
class: the verdict keeps that much free before it says FITS. Rows that offload to the host are left
out (their device allocations are not the plan's classes); so are rows under 2 GiB allocated, where
the 2 MiB and 20 MiB segment granularity, not the workload, sets the ratio.

Expandable segments (the engine's default, memory.expandable_segments) have no GPU measurement yet:
their factors come from the same rows' traces replayed through plan/allocator.py in that mode
(bench/reserved_replay.py --out), (replayed reserved - the cuBLAS workspaces) / traced peak - 1, and
the source says so. The next lent GPU measures the mode (bench/gpu_validate.py's pairs).

With --replays it also writes `replay_miss`: per class, the replay's worst under-prediction of a
measured row's reserved bytes, which `trainplan trace` keeps on top of its own replayed figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainplan import config as C  # noqa: E402
from trainplan.plan.fragmentation import workload_class  # noqa: E402

MIN_ALLOCATED = 2 << 30
HOST_SETTINGS = ("offload_optimizer", "offload_activations")


def rows_of(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(path.read_text())
        version = data["versions"]["torch"]
        for row in data["rows"]:
            m = row.get("measured") or {}
            if row.get("status") != "ok" or not m.get("peak_reserved_bytes") or row["name"].endswith("hf:liger"):
                continue
            if any(s in " ".join(row["settings"]) for s in HOST_SETTINGS) or m["peak_allocated_bytes"] < MIN_ALLOCATED:
                continue
            c = row["config"]
            rows.append(
                {
                    "name": row["name"],
                    "class": workload_class(c["mode"], c["checkpointing"] or bool(c.get("checkpointing_chosen"))),
                    "fragmentation": m["peak_reserved_bytes"] / m["peak_allocated_bytes"] - 1,
                    "torch": version,
                    "source": path.name,
                }
            )
    return rows


def replay_rows(path: Path) -> list[dict]:
    """The expandable-segments replay of each row, as rows_of's rows (offload rows left out as above)."""
    workspace = C.HardwareConfig().cublas_workspace_mib << 20  # in the replayed figure, billed as runtime
    data = json.loads(path.read_text())
    rows = []
    for row in data["rows"]:
        if any(s in row["name"] for s in HOST_SETTINGS) or row["measured_allocated_bytes"] < MIN_ALLOCATED:
            continue
        mode, ac = _class_of(row["name"])
        reserve = row["replay_expandable_reserved_bytes"] - workspace
        rows.append(
            {
                "name": row["name"],
                "class": workload_class(mode, ac),
                "fragmentation": max(0.0, reserve / row["traced_peak_bytes"] - 1),
            }
        )
    return rows


def replay_miss(path: Path) -> float:
    """The replay's worst under-prediction of measured reserved memory (default mode), offload rows
    left out: what a replayed figure may still lack."""
    rows = json.loads(path.read_text())["rows"]
    return max(0.0, *(-r["replay_vs_measured"] for r in rows if not any(s in r["name"] for s in HOST_SETTINGS)))


def replay_misses(path: Path) -> dict[str, dict]:
    """Per workload class, the replay's worst under-prediction of a measured row's reserved bytes
    (default mode, offload rows left out): what `trace`'s replayed figure keeps on top of itself."""
    classes: dict[str, dict] = {}
    for row in json.loads(path.read_text())["rows"]:
        if any(s in row["name"] for s in HOST_SETTINGS):
            continue
        worst = classes.setdefault(
            workload_class(*_class_of(row["name"])), {"fraction": 0.0, "rows": 0, "worst_row": ""}
        )
        worst["rows"] += 1
        if -row["replay_vs_measured"] > worst["fraction"]:
            worst["fraction"], worst["worst_row"] = -row["replay_vs_measured"], row["name"]
    for c in classes.values():
        c["fraction"] = math.ceil(c["fraction"] * 1e4) / 1e4  # rounded up: never under the measured worst
    return dict(sorted(classes.items()))


def _class_of(name: str) -> tuple[str, bool]:
    """(mode, checkpointing) from a gpu_validate row name: 'Llama-3.2-1B lora amp-bf16 mb4 s512 AC ...'."""
    words = name.split()
    return words[1], "AC" in words


def fit(rows: list[dict]) -> dict[str, dict]:
    classes: dict[str, dict] = {}
    for row in rows:
        worst = classes.setdefault(row["class"], {"factor": 0.0, "rows": 0, "worst_row": ""})
        worst["rows"] += 1
        if row["fragmentation"] > worst["factor"]:
            worst["factor"], worst["worst_row"] = row["fragmentation"], row["name"]
    for c in classes.values():
        c["factor"] = math.ceil(c["factor"] * 1e3) / 1e3  # rounded up: never under the measured worst
    return dict(sorted(classes.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path, help="gpu_validate JSON files")
    ap.add_argument("--replays", type=Path, help="bench/reserved_replay.py's JSON: the expandable-segments factors")
    ap.add_argument("--out", type=Path, help="write the factors here (trainplan/plan/fragmentation.json)")
    ap.add_argument("--quick", action="store_true", help="the recorded runs and replays of docs/data, nothing written")
    args = ap.parse_args()
    if args.quick:
        data = Path(__file__).parents[1] / "docs" / "data"
        args.runs = args.runs or sorted(data.glob("gpu-validate-h200-2026-12-04*.json"))
        args.replays = args.replays or data / "reserved-replay-h200-2026-12-04.json"
    if not args.runs:
        ap.error("the runs: give bench/gpu_validate.py JSON files (or --quick)")
    rows = rows_of(args.runs)
    seen: dict[str, dict] = {}
    for row in rows:  # a row measured in several runs counts once (the allocator is deterministic)
        seen[row["name"]] = row
    rows = list(seen.values())
    classes = fit(rows)
    for row in sorted(rows, key=lambda r: (r["class"], -r["fragmentation"])):
        print(f"{row['class']:<14} {row['fragmentation']:+7.1%}  {row['name']}")
    for name, c in classes.items():
        print(f"class {name}: {c['factor']:.1%} over {c['rows']} rows (worst: {c['worst_row']})")
    if args.out:
        torch_versions = sorted({r["torch"] for r in rows})
        sources = sorted({r["source"] for r in rows})
        doc = {
            "default": {
                "source": f"bench/fit_reserve.py over {', '.join(sources)}: max_memory_reserved measured on a GPU "
                f"(torch {', '.join(torch_versions)}, default allocator: expandable_segments off)",
                "classes": classes,
            }
        }
        if args.replays:
            replayed = replay_rows(args.replays)
            for row in sorted(replayed, key=lambda r: (r["class"], -r["fragmentation"])):
                print(f"expandable {row['class']:<14} {row['fragmentation']:+7.1%}  {row['name']}")
            miss = replay_miss(args.replays)
            classes = fit(replayed)
            for c in classes.values():  # the replay's own worst under-prediction of a measured row, on top
                c["factor"] = math.ceil((c["factor"] + miss) * 1e3) / 1e3
                c["replay_miss"] = miss
            misses = replay_misses(args.replays)
            for name, c in misses.items():
                print(f"replay miss {name}: {c['fraction']:.2%} over {c['rows']} rows (worst: {c['worst_row'] or '-'})")
            doc["replay_miss"] = {
                "source": f"bench/fit_reserve.py over {args.replays.name}: the replay's worst under-prediction "
                "of a measured row's max_memory_reserved, per class (docs/gpu-validation.md)",
                "classes": misses,
            }
            doc["expandable_segments"] = {
                "source": f"bench/fit_reserve.py over {args.replays.name}: traces replayed through "
                f"plan/allocator.py with expandable_segments, plus the replay's worst under-prediction of a "
                f"measured row ({miss:.1%}); not yet measured on a GPU",
                "classes": classes,
            }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
