"""The analytic plan's known error per architecture and mode, from bench/trace_accuracy.py.

Each bench row plans a real-size configuration and traces it on fake tensors; an architecture's
band in a mode (full, lora, inference) is its worst under-prediction over those rows (0 where the
plan was never under). QLoRA cannot be traced (bitsandbytes' 4-bit kernels): its rows are the GPU's,
the analytic peak against the storage tracker's (`--measured`). The verdict keeps that fraction of
the peak free before it says a plan fits, and says so. A mode without rows of its own on an
architecture gets the widest band of that architecture's other modes and of the mode on any other
architecture; an architecture without rows (derived terms, or a type the bench does not cover yet)
gets the widest band measured, and at least DERIVED_MIN_BAND. Imports no torch.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

BANDS_FILE = Path(__file__).with_name("accuracy.json")  # written by bench/trace_accuracy.py --bands
DERIVED_MIN_BAND = 0.01  # issue 17's bound for derived terms against a full trace


@functools.cache
def _bands() -> dict:
    try:
        data = json.loads(BANDS_FILE.read_text())
        bands = {
            str(arch): {str(mode): float(v) for mode, v in by_mode.items()} for arch, by_mode in data["bands"].items()
        }
        return {"bands": bands, "source": str(data["source"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"bands": {}, "source": ""}


def band(model_type: str, mode: str, *, derived: bool) -> tuple[float, str]:
    """(fraction of the peak, where it comes from) for one architecture in one mode."""
    data = _bands()
    bands, source = data["bands"], data["source"]
    every = [v for by_mode in bands.values() for v in by_mode.values()]
    if derived or model_type not in bands:
        why = "derived terms" if derived else f"no {model_type} rows in {source or 'the accuracy table'}"
        return max([DERIVED_MIN_BAND, *every]), f"{why}: the widest band measured"
    own = bands[model_type]
    if mode in own:
        rows = f"{source}, {model_type} {mode} rows"
        return own[mode], f"the plan's worst under-prediction on {rows}" if own[mode] else ""
    same_mode = [by_mode[mode] for by_mode in bands.values() if mode in by_mode]
    widest = max([0.0, *own.values(), *same_mode])
    why = f"no {model_type} {mode} rows in {source}: the widest of its other modes and of {mode} elsewhere"
    return widest, why if widest else ""
