"""The caching allocator's reserve over the tensors, per workload class, for the analytic plan.

The analytic plan has no event stream to replay through the allocator's rules, so it keeps a
fraction of its peak for what the CUDA caching allocator reserves beyond the live tensors (cached
free blocks, split remainders, segment rounding). Written by bench/fit_reserve.py:
- default allocator: the worst measured on a GPU for the class (bench/gpu_validate.py's runs);
- expandable segments: the worst of the same rows' traces replayed through plan/allocator.py in that
  mode (bench/reserved_replay.py), since no GPU has measured the mode yet; the source says so.
A class without rows gets the widest factor of its mode. `hardware.allocator_reserve` overrides it.

`trainplan trace` replays its own stream instead, and keeps on top of the replayed figure the replay's
worst under-prediction of a measured row of the class (`replay_miss`): 5.7% for LoRA with checkpointing,
whose one measured row reserved more than its fake-tensor stream replays to (docs/gpu-validation.md).
Imports no torch.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

FACTORS_FILE = Path(__file__).with_name("fragmentation.json")
FALLBACK = 0.05  # no file at all: the flat reserve Megatron's theoretical memory uses


def workload_class(mode: str, checkpointing: bool) -> str:
    """'full', 'full+ac', 'lora', 'lora+ac', 'inference'; QLoRA counts as LoRA."""
    if mode == "inference":
        return "inference"
    base = "full" if mode == "full" else "lora"  # the adapters train either way
    return base + ("+ac" if checkpointing else "")


@functools.cache
def _factors(expandable: bool = False) -> tuple[dict[str, float], str]:
    key = "expandable_segments" if expandable else "default"
    try:
        data = json.loads(FACTORS_FILE.read_text())[key]
        return {str(k): float(v["factor"]) for k, v in data["classes"].items()}, str(data["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, ""


def reserve_fraction(mode: str, checkpointing: bool, *, expandable: bool = False) -> tuple[float, str]:
    """(fraction of the peak allocated, why) for one workload class, in one allocator mode."""
    factors, source = _factors(expandable)
    cls = workload_class(mode, checkpointing)
    if cls in factors:
        return factors[cls], f"the worst {cls} row ({source})"
    if factors:
        return max(factors.values()), f"no {cls} rows: the widest class ({source})"
    return FALLBACK, "a flat 5%: no measured factors shipped"


@functools.cache
def _misses() -> tuple[dict[str, tuple[float, str]], str]:
    try:
        data = json.loads(FACTORS_FILE.read_text())["replay_miss"]
        classes = {str(k): (float(v["fraction"]), str(v["worst_row"])) for k, v in data["classes"].items()}
        return classes, str(data["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, ""


def replay_miss(mode: str, checkpointing: bool) -> tuple[float, str]:
    """(fraction of the replayed reserved bytes, why) that a replayed figure keeps on top of itself: the
    replay's worst under-prediction of a measured row of the class, or the widest class's without rows."""
    classes, source = _misses()
    cls = workload_class(mode, checkpointing)
    if cls in classes:
        fraction, row = classes[cls]
        return fraction, f"the replay's worst {cls} miss ({row or 'none under'}; {source})"
    if classes:
        fraction, row = max(classes.values())
        return fraction, f"no {cls} rows: the widest class's miss ({row}; {source})"
    return 0.0, "no measured replay misses shipped"
