"""What the data's packing (data.packing, run/data.py) adds to an analytic plan: the notes. The terms are in
plan/activations.py (packed documents' attention runs one document a call with no mask, run/attention.py: the
output assembled from the calls, the per-row position ids and rotary tables); the packing comes from the
data's first row (run/sources.py packing). Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.run import sources

if TYPE_CHECKING:
    from trainplan.resolve import Resolved


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
        if r.attention == "eager":
            return [f"Documents packed apart ({why}): eager attention's block-causal (s x s) mask is in the bill."]
        return [f"Documents packed apart ({why}): SDPA attends one document a call, with no (s x s) mask."]
    return []
