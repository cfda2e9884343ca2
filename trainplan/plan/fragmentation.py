"""The caching allocator's reserve over the tensors, per workload class, for the analytic plan.

The analytic plan has no event stream to replay through the allocator's rules, so it keeps a
fraction of its peak for what the CUDA caching allocator reserves beyond the live tensors (cached
free blocks, split remainders, segment rounding). The fraction is the worst measured on a GPU for the
same class of workload, written by bench/fit_reserve.py from bench/gpu_validate.py's runs. A class
that was never measured gets the widest factor measured. `hardware.allocator_reserve` overrides it.
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
def _factors() -> tuple[dict[str, float], str]:
    try:
        data = json.loads(FACTORS_FILE.read_text())
        return {str(k): float(v["factor"]) for k, v in data["classes"].items()}, str(data["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, ""


def reserve_fraction(mode: str, checkpointing: bool) -> tuple[float, str]:
    """(fraction of the peak allocated, why) for one workload class."""
    factors, source = _factors()
    cls = workload_class(mode, checkpointing)
    if cls in factors:
        return factors[cls], f"the worst {cls} row measured ({source})"
    if factors:
        return max(factors.values()), f"no {cls} rows measured: the widest class measured ({source})"
    return FALLBACK, "a flat 5%: no measured factors shipped"
