"""What the data's packing (data.packing, run/data.py) adds to an analytic plan: the accuracy band of the
packed documents' mask terms, and the notes. The terms themselves are in plan/activations.py (SDPA's
mask copy, K and V repeated) and plan/terms.py (the bool mask kept or alive); the packing comes from the
data's first row (run/sources.py packing). Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.run import sources

if TYPE_CHECKING:
    from trainplan.resolve import Resolved

# the worst plan-vs-trace miss of document packing's mask terms, rounded up: tiny Llama, seq 256 and 1024,
# full and LoRA, with and without checkpointing (worst -1.32%, LoRA at seq 1024, its forward)
PACKED_BAND = 0.015


def band(r: Resolved, band: float, source: str) -> tuple[float, str]:
    """The accuracy band, widened where packed documents' masks are in the bill."""
    if r.training and sources.packing(r.cfg.data)[0] == "document" and r.attention != "eager":
        return band + PACKED_BAND, f"{source}; + {PACKED_BAND:.1%} for packed documents' masks"
    return band, source


def notes(r: Resolved) -> list[str]:
    packing, why = sources.packing(r.cfg.data)
    seq, longest = r.batch.seq_len, r.cfg.data.max_length
    if r.training and packing == "none" and longest > seq:
        return [
            f"One document a row ({why}) up to data.max_length {longest}: a micro-batch of rows longer than "
            f"seq_len {seq} needs more than this plan; `trainplan plan --data` plans the run's widest "
            "micro-batch and names its step."
        ]
    if r.training and packing == "document":
        return [f"Documents packed apart ({why}): their block-causal mask is in the bill."]
    return []
