"""The analytic plan's known error per architecture, from bench/trace_accuracy.py.

Each bench row plans a real-size configuration and traces it on fake tensors; an architecture's
band is its worst under-prediction over those rows (0 where the plan was never under). The
verdict keeps that fraction of the peak free before it says a plan fits, and says so. An
architecture without rows (derived terms, or a type the bench does not cover yet) gets the widest
band measured, and at least DERIVED_MIN_BAND. Imports no torch.
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
        return {"bands": {str(k): float(v) for k, v in data["bands"].items()}, "source": str(data["source"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"bands": {}, "source": ""}


def band(model_type: str, *, derived: bool) -> tuple[float, str]:
    """(fraction of the peak, where it comes from) for one architecture."""
    data = _bands()
    bands, source = data["bands"], data["source"]
    if not derived and model_type in bands:
        rows = f"{source}, {model_type} rows"
        return bands[model_type], f"the plan's worst under-prediction on {rows}" if bands[model_type] else ""
    widest = max([DERIVED_MIN_BAND, *bands.values()])
    why = "derived terms" if derived else f"no {model_type} rows in {source or 'the accuracy table'}"
    return widest, f"{why}: the widest band measured"
