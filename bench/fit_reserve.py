"""Fit the analytic plan's allocator reserve per workload class from measured GPU runs.

Run: .venv/bin/python bench/fit_reserve.py docs/data/gpu-validate-h200-2026-12-04*.json \
        --out trainplan/plan/fragmentation.json

The CUDA caching allocator reserves more than the tensors hold: blocks cached after a free, split
remainders, segments rounded up (c10/cuda/CUDACachingAllocator.cpp). A row's fragmentation is
(max_memory_reserved - max_memory_allocated) / max_memory_allocated, both measured on the same step,
so the plan's own error (the accuracy band) is not in it. A class's factor is the worst row of that
class: the verdict keeps that much free before it says FITS. Rows that offload to the host are left
out (their device allocations are not the plan's classes); so are rows under 2 GiB allocated, where
the 2 MiB and 20 MiB segment granularity, not the workload, sets the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    ap.add_argument("runs", nargs="+", type=Path, help="gpu_validate JSON files")
    ap.add_argument("--out", type=Path, help="write the factors here (trainplan/plan/fragmentation.json)")
    args = ap.parse_args()
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
            "source": f"bench/fit_reserve.py over {', '.join(sources)} (torch {', '.join(torch_versions)}, "
            "default allocator: expandable_segments off)",
            "classes": classes,
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
