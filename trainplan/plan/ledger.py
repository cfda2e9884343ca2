"""The ledger: bytes per component, per phase, per device, with the verdict and the reasons.

Component names are shared with the traced plan and with the measurements, so a plan and a
measurement line up row by row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from trainplan.spec.devices import DeviceSpec, GiB, format_gib

SCHEMA = "trainplan.plan/1"

COMPONENTS = (
    "weights",  # parameters as stored (sharded where the strategy shards them)
    "weight_copies",  # autocast casts, FSDP all-gathered units, QLoRA dequantized weight
    "adapter",  # LoRA A/B: weights, gradients, optimizer states (fp32)
    "gradients",
    "optimizer",  # optimizer states
    "optimizer_temp",  # temporaries inside optimizer.step()
    "activations",  # tensors saved for backward (inference: the largest transient)
    "logits_loss",  # logits and cross-entropy buffers
    "kv_cache",
    "buffers",  # registered module buffers (rotary frequencies, ...)
    "comm_buffers",  # reduce-scatter / pipeline send-recv buffers
    "runtime",  # CUDA context + cuBLAS workspace, or the CPU process's libraries
    "allocator_reserve",  # cached-but-unused allocator blocks
)

RESULT_FITS, RESULT_DOES_NOT_FIT, RESULT_BAD_INPUT = 0, 1, 2


# Comparison groups: the tracker's categories cannot tell an autocast copy or a logits buffer
# from other forward tensors, so analytic and traced bills are compared on these sums.
GROUPS = {
    "states": ("weights", "adapter", "buffers"),
    "gradients": ("gradients",),
    "optimizer": ("optimizer", "optimizer_temp"),
    "activations+": ("activations", "logits_loss", "weight_copies", "comm_buffers", "kv_cache"),
}


@dataclass(kw_only=True)
class DeviceLedger:
    """One device's bill. `phases` holds allocated bytes per component in each phase."""

    label: str  # "GPU 0", "host"
    device: DeviceSpec
    role: str
    phases: dict[str, dict[str, int]]
    runtime_bytes: int
    reserve_fraction: float
    safety_margin: float = 0.0
    explain: dict[str, str] = field(default_factory=dict)
    details: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)
    offload_bytes: int = 0  # what this rank keeps in host memory (optimizer offload)
    # memory.offload_activations: what the hooks pass to the host per step (on the CPU too, where it stays),
    # and what that holds in host memory (the host column; none on the CPU)
    offloaded_activation_bytes: int = 0
    host_activation_bytes: int = 0
    # The plan's known under-prediction for this architecture, a fraction of the peak (plan/accuracy.py):
    # kept free on top of the bill before the verdict says it fits.
    error_band: float = 0.0
    error_band_source: str = ""
    budget_bytes: int | None = None  # hardware.memory_budget: a cap on the bill below the device's capacity

    def for_rank(self, *, label: str, device: DeviceSpec, role: str, rank: int) -> DeviceLedger:
        """This bill on another rank of the same kind: the ranks share the bill's dicts (and its peak)."""
        self.peak_allocated  # noqa: B018 -- summed here, once for every rank that shares the bill
        other = object.__new__(DeviceLedger)
        other.__dict__.update(self.__dict__)
        other.label, other.device, other.role, other.ranks = label, device, role, [rank]
        return other

    def phase_total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @functools.cached_property
    def peak_allocated(self) -> int:
        """Summed once: the advisor asks each bill whether it fits thousands of times. A bill's
        phases are not changed once built (a changed bill is a new DeviceLedger)."""
        return max(sum(components.values()) for components in self.phases.values())

    @property
    def reserve_bytes(self) -> int:
        return self._reserve(self.peak_allocated)

    def _reserve(self, peak: int) -> int:
        return int(self.reserve_fraction * peak)

    @property
    def components(self) -> dict[str, int]:
        """Bytes per component at the peak phase, plus runtime and allocator reserve."""
        at_peak = dict(self.phases[self.peak_phase])
        at_peak["runtime"] = self.runtime_bytes
        at_peak["allocator_reserve"] = self.reserve_bytes
        return {c: at_peak.get(c, 0) for c in COMPONENTS}

    @property
    def total_bytes(self) -> int:
        return self._total(self.peak_allocated)

    def _total(self, peak: int) -> int:
        return peak + self.runtime_bytes + self._reserve(peak)

    @property
    def usable_bytes(self) -> int:
        usable = int(self.device.capacity_bytes * (1 - self.safety_margin))
        return usable if self.budget_bytes is None else min(usable, self.budget_bytes)

    @property
    def usable_text(self) -> str:
        """'79.65 GiB usable', or '20.00 GiB usable (hardware.memory_budget)' when the budget binds."""
        budget = self.budget_bytes is not None and self.usable_bytes == self.budget_bytes
        return f"{gib(self.usable_bytes)} usable" + (" (hardware.memory_budget)" if budget else "")

    @property
    def error_margin_bytes(self) -> int:
        return self._error_margin(self.peak_allocated)

    def _error_margin(self, peak: int) -> int:
        return math.ceil(self.error_band * peak)

    @property
    def headroom_bytes(self) -> int:
        peak = self.peak_allocated
        return self.usable_bytes - self._total(peak) - self._error_margin(peak)

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def largest_component(self) -> str:
        comps = self.components
        return max(comps, key=comps.get)

    def bill_key(self) -> tuple:
        """Devices with the same bill and device type are shown as one column."""
        return (
            self.device.name,
            self.device.capacity_bytes,
            self.role.split(" rank")[0],
            tuple(sorted(self.components.items())),
            tuple(self.phases),
        )

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "ranks": self.ranks,
            "device": self.device.name,
            "kind": self.device.kind,
            "capacity_bytes": self.device.capacity_bytes,
            "usable_bytes": self.usable_bytes,
            "budget_bytes": self.budget_bytes,
            "role": self.role,
            "components": self.components,
            "phases": {p: {**c, "total": sum(c.values())} for p, c in self.phases.items()},
            "peak_phase": self.peak_phase,
            "peak_allocated_bytes": self.peak_allocated,
            "total_bytes": self.total_bytes,
            "error_band": self.error_band,
            "error_margin_bytes": self.error_margin_bytes,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "largest_component": self.largest_component,
            "explain": self.explain,
            "details": {k: [{"name": n, "bytes": b} for n, b in v] for k, v in self.details.items()},
        } | ({"offloaded_activation_bytes": self.offloaded_activation_bytes} if self.offloaded_activation_bytes else {})


@dataclass(kw_only=True)
class Ledger:
    model: dict
    settings: dict
    devices: list[DeviceLedger]  # one per rank
    host: DeviceLedger | None = None
    notes: list[str] = field(default_factory=list)
    source: str = "analytic"

    @property
    def all_ledgers(self) -> list[DeviceLedger]:
        return self.devices + ([self.host] if self.host else [])

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.all_ledgers)

    @property
    def exit_code(self) -> int:
        return RESULT_FITS if self.fits else RESULT_DOES_NOT_FIT

    def verdict(self) -> str:
        bad, seen = [], set()
        for d in self.all_ledgers:
            if not d.fits and d.bill_key() not in seen:
                seen.add(d.bill_key())
                bad.append(d)
        if not bad:
            tight = min(self.all_ledgers, key=lambda d: d.headroom_bytes)
            return (
                f"FITS on every device; least headroom {gib(tight.headroom_bytes)} on {tight.label} "
                f"({tight.device.name}) at the {tight.peak_phase} peak" + _band_text(tight)
            )
        parts = []
        for d in bad:
            comp = d.largest_component
            alike = sum(1 for x in self.devices if x is not d and x.bill_key() == d.bill_key())
            label = d.label + (f" and {alike} alike" if alike else "")
            parts.append(
                f"{label} ({d.device.name}, {d.usable_text}) needs "
                f"{gib(d.total_bytes)} at the {d.peak_phase} peak, over by {gib(-d.headroom_bytes)}"
                f"{_band_text(d)}; largest component {comp} {gib(d.components[comp])}"
            )
        text = "DOES NOT FIT: " + "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
        capacity = sum(d.usable_bytes for d in self.devices)
        needed = sum(d.total_bytes for d in self.devices)
        if len(self.devices) > 1 and needed <= capacity:
            text += (
                f". The devices' combined memory ({gib(capacity)}) would cover the combined bill "
                f"({gib(needed)}), but memory does not pool across devices: each must hold its own share"
            )
        return text

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "source": self.source,
            "model": self.model,
            "settings": self.settings,
            "devices": [d.to_json() for d in self.devices],
            "host": self.host.to_json() if self.host else None,
            "verdict": {
                "fits": self.fits,
                "summary": self.verdict(),
                "overflows": [
                    {
                        "label": d.label,
                        "device": d.device.name,
                        "over_bytes": -d.headroom_bytes,
                        "component": d.largest_component,
                        "phase": d.peak_phase,
                    }
                    for d in self.all_ledgers
                    if not d.fits
                ],
            },
            "notes": self.notes,
        }


def _band_text(d: DeviceLedger) -> str:
    if not d.error_band:
        return ""
    return f", after a {gib(d.error_margin_bytes)} margin ({d.error_band:.2%} of the peak: {d.error_band_source})"


def gib(n: int) -> str:
    """Human bytes: GiB from 1 GiB up, MiB below."""
    if abs(n) >= GiB:
        return format_gib(n)
    return f"{n / (1 << 20):.1f} MiB"


def _group(ledger: Ledger) -> list[tuple[str, DeviceLedger]]:
    """Columns: identical devices with identical bills share one column ('GPU 0-7')."""
    groups: dict[tuple, list[DeviceLedger]] = {}
    for d in ledger.devices:
        groups.setdefault(d.bill_key(), []).append(d)
    cols = []
    for members in groups.values():
        first = members[0]
        if len(members) == 1:
            title = first.label
        else:
            title = f"{first.label} (+{len(members) - 1} alike)"
        cols.append((title, first))
    if ledger.host:
        cols.append(("host", ledger.host))
    return cols


def _phases(cols: list[tuple[str, DeviceLedger]]) -> list[str]:
    """Every phase of the run, in the order it happens."""
    seen: dict[str, None] = {}
    for _, d in cols:
        seen.update(dict.fromkeys(d.phases))
    return list(seen)


def render_table(ledger: Ledger, *, terminal: bool = False) -> str:
    """The ledger as text: a table of components per device (identical devices share a column),
    the verdict, and why each component costs what it does. 100 columns wide off a terminal."""
    from trainplan.text import cell, columns, render, table, wrap

    cols = _group(ledger)
    t = table("component", *(f"{title}\n{d.device.name}\n{d.role}>" for title, d in cols))
    for comp in COMPONENTS:
        vals = [d.components[comp] for _, d in cols]
        if any(vals):
            t.add_row(comp, *(f"{v / GiB:.2f}" for v in vals))
    t.add_section()
    t.add_row("TOTAL (GiB)", *(f"{d.total_bytes / GiB:.2f}" for _, d in cols), style="bold")
    t.add_row("capacity (GiB)", *(f"{d.usable_bytes / GiB:.2f}" for _, d in cols))
    t.add_row("headroom (GiB)", *(f"{d.headroom_bytes / GiB:+.2f}" for _, d in cols))
    t.add_row("peak phase", *(d.peak_phase for _, d in cols))
    for phase in _phases(cols):
        t.add_row(
            f"  at {phase}", *(f"{d.phase_total(phase) / GiB:.2f}" if phase in d.phases else "-" for _, d in cols)
        )
    t.add_row("verdict", *(cell("fits", "green") if d.fits else cell("DOES NOT FIT", "bold red") for _, d in cols))
    width = columns(terminal)
    head = (
        f"trainplan plan — {ledger.model['name']} ({ledger.model['params'] / 1e6:,.1f}M params), "
        f"{ledger.settings['summary']}"
    )
    first = cols[0][1]
    why = [f"Why ({first.label}, {first.peak_phase} peak):"]
    if first.peak_phase in first.explain:
        why.append(wrap(f"{first.peak_phase}: {first.explain[first.peak_phase]}", indent="  ", width=width))
    why += [
        wrap(f"{c}: {first.explain[c]}", indent="  ", width=width)
        for c in COMPONENTS
        if first.components[c] and c in first.explain
    ]
    out = [wrap(head, width=width), "", render(t, terminal=terminal), "", wrap(ledger.verdict(), width=width), ""]
    out += why
    if ledger.notes:
        out += ["", "Notes:"] + [wrap(f"- {n}", indent="  ", hang="  ", width=width) for n in ledger.notes]
    return "\n".join(out)


def render_markdown(ledger: Ledger) -> str:
    cols = _group(ledger)
    out = [
        f"## trainplan plan: {ledger.model['name']}",
        "",
        f"{ledger.settings['summary']}",
        "",
        "| component | " + " | ".join(f"{t} ({d.device.name})" for t, d in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for comp in COMPONENTS:
        vals = [d.components[comp] for _, d in cols]
        if any(vals):
            out.append(f"| {comp} | " + " | ".join(f"{v / GiB:.2f}" for v in vals) + " |")
    out.append("| **total (GiB)** | " + " | ".join(f"**{d.total_bytes / GiB:.2f}**" for _, d in cols) + " |")
    out.append("| capacity (GiB) | " + " | ".join(f"{d.usable_bytes / GiB:.2f}" for _, d in cols) + " |")
    out.append("| headroom (GiB) | " + " | ".join(f"{d.headroom_bytes / GiB:+.2f}" for _, d in cols) + " |")
    out.append("| peak phase | " + " | ".join(d.peak_phase for _, d in cols) + " |")
    for phase in _phases(cols):
        out.append(
            f"| at {phase} (GiB, allocated) | "
            + " | ".join(f"{d.phase_total(phase) / GiB:.2f}" if phase in d.phases else "-" for _, d in cols)
            + " |"
        )
    out += ["", f"**{ledger.verdict()}**", ""]
    first = cols[0][1]
    out += [f"- **{c}**: {first.explain[c]}" for c in COMPONENTS if first.components[c] and c in first.explain]
    if ledger.notes:
        out += [""] + [f"> {n}" for n in ledger.notes]
    return "\n".join(out) + "\n"
