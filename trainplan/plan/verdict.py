"""The verdict: one function decides whether a plan fits, for `plan`, `trace`, `advise`, `launch` and
`accept` alike.

Each device needs its peak allocated bytes plus its runtime (CUDA context and workspaces, or the CPU
process). On top of that the verdict keeps a margin for what the plan cannot see exactly:

- accuracy: the analytic plan's worst measured under-prediction for the architecture (plan/accuracy.py);
- allocator: what the CUDA caching allocator reserves beyond the tensors (plan/fragmentation.py, or
  hardware.allocator_reserve; under `trace`, the replay of its own stream plus the replay's measured
  miss for the workload class).

FITS: the headroom covers the margin. TIGHT: the tensors fit but the headroom is under the margin, so the
run may run out of memory. DOES NOT FIT: the need alone exceeds the usable memory. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainplan.errors import EXIT_FAILED, EXIT_OK
from trainplan.spec.devices import gib

if TYPE_CHECKING:
    from trainplan.plan.ledger import DeviceLedger, Ledger

FITS, TIGHT, DOES_NOT_FIT = "FITS", "TIGHT", "DOES NOT FIT"
_ORDER = {FITS: 0, TIGHT: 1, DOES_NOT_FIT: 2}


def device_state(d: DeviceLedger) -> str:
    """FITS / TIGHT / DOES NOT FIT for one device's bill."""
    if d.headroom_bytes >= 0:
        return FITS
    return TIGHT if d.usable_bytes >= d.need_bytes else DOES_NOT_FIT


def margin_text(d: DeviceLedger) -> str:
    """'a 1.20 GiB margin: accuracy 23.0 MiB (0.03% of the peak: ...), caching allocator 1.18 GiB (...)'."""
    parts = []
    if d.error_margin_bytes:
        parts.append(f"accuracy {gib(d.error_margin_bytes)} ({d.error_band:.2%} of the peak: {d.error_band_source})")
    if d.reserve_bytes:
        share = f"{d.reserve_fraction:.1%} of the peak: {d.reserve_source}"
        parts.append(f"caching allocator {gib(d.reserve_bytes)} ({share})")
    if not parts:
        return "no margin"
    return f"a {gib(d.margin_bytes)} margin: " + ", ".join(parts)


@dataclass(frozen=True)
class Verdict:
    state: str  # the worst device's
    summary: str
    tightest: DeviceLedger  # the device with the least headroom over its margin

    def exit_code(self, *, strict: bool = False) -> int:
        """0 FITS; TIGHT 0 (1 with --strict); 1 DOES NOT FIT."""
        if self.state == DOES_NOT_FIT or (strict and self.state == TIGHT):
            return EXIT_FAILED
        return EXIT_OK

    def to_json(self) -> dict:
        d = self.tightest
        return {
            "state": self.state,
            "fits": self.state == FITS,
            "summary": self.summary,
            "tightest": d.label,
            "margin": d.margin_json(),
        }


def verdict(ledger: Ledger) -> Verdict:
    """The one verdict over every device of a plan, host included."""
    devices = ledger.all_ledgers
    state = max((device_state(d) for d in devices), key=_ORDER.__getitem__)
    tightest = min(devices, key=lambda d: d.headroom_bytes)
    if state == FITS:
        summary = _fits_text(tightest)
    elif state == TIGHT:
        summary = _tight_text(ledger)
    else:
        summary = _over_text(ledger)
    return Verdict(state=state, summary=summary, tightest=tightest)


def _fits_text(d: DeviceLedger) -> str:
    return (
        f"FITS on every device; least headroom {gib(d.headroom_bytes)} on {d.label} ({d.device.name}) "
        f"at the {d.peak_phase} peak, after {margin_text(d)}"
    )


def _distinct(ledger: Ledger, state: str) -> list[tuple[DeviceLedger, str]]:
    """Devices in `state`, one per distinct bill, each with its label ('GPU 0 and 7 alike')."""
    out, seen = [], set()
    for d in ledger.all_ledgers:
        if device_state(d) != state or d.bill_key() in seen:
            continue
        seen.add(d.bill_key())
        alike = sum(1 for x in ledger.devices if x is not d and x.bill_key() == d.bill_key())
        out.append((d, d.label + (f" and {alike} alike" if alike else "")))
    return out


def _tight_text(ledger: Ledger) -> str:
    parts = [
        f"{label} ({d.device.name}, {d.usable_text}) needs {gib(d.need_bytes)} at the {d.peak_phase} peak, "
        f"leaving {gib(d.usable_bytes - d.need_bytes)} where the plan keeps {margin_text(d)}"
        for d, label in _distinct(ledger, TIGHT)
    ]
    return "TIGHT: may run out of memory: " + "; ".join(parts[:3]) + _more(parts)


def _over_text(ledger: Ledger) -> str:
    parts = []
    for d, label in _distinct(ledger, DOES_NOT_FIT):
        comp = d.largest_component
        parts.append(
            f"{label} ({d.device.name}, {d.usable_text}) needs {gib(d.need_bytes)} at the {d.peak_phase} peak "
            f"before any margin, over by {gib(d.need_bytes - d.usable_bytes)}; largest component {comp} "
            f"{gib(d.components[comp])}"
        )
    text = "DOES NOT FIT: " + "; ".join(parts[:3]) + _more(parts)
    capacity = sum(d.usable_bytes for d in ledger.devices)
    needed = sum(d.need_bytes for d in ledger.devices)
    if len(ledger.devices) > 1 and needed <= capacity:
        text += (
            f". The devices' combined memory ({gib(capacity)}) would cover the combined bill "
            f"({gib(needed)}), but memory does not pool across devices: each must hold its own share"
        )
    return text


def _more(parts: list[str]) -> str:
    return f"; and {len(parts) - 3} more" if len(parts) > 3 else ""
