"""The ledger: bytes per component, per phase, per device, with the verdict and the reasons.

Component names are shared with the traced plan and with the measurements, so a plan and a
measurement line up row by row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from trainplan.plan.parts import parts_of
from trainplan.spec.devices import DeviceSpec, GiB, gib  # noqa: F401 -- gib: callers take it from here

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
    reserve_source: str = ""  # where reserve_fraction comes from (plan/fragmentation.py or the setting)
    # peak reserved bytes per phase where a replay of the traced stream gave them (plan/allocator.py);
    # otherwise each phase's total plus reserve_fraction of it
    replayed_reserved: dict[str, int] = field(default_factory=dict)
    # the caching allocator's mode the reserve is planned for: "expandable_segments" or "default"
    # (PYTORCH_CUDA_ALLOC_CONF unset), from memory.expandable_segments
    allocator_mode: str = "default"
    safety_margin: float = 0.0
    explain: dict[str, str] = field(default_factory=dict)
    # the bytes each component's note explains: a figure at the peak that is not this, or not a
    # plan/phase.Bytes naming its terms, is one the why line cannot account for (tests/plan/test_why_sums.py)
    noted: dict[str, int] = field(default_factory=dict)
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
        return sum(map(int, self.phases[phase].values()))  # the figure: Bytes' terms are the why line's

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @functools.cached_property
    def peak_allocated(self) -> int:
        """Summed once: the advisor asks each bill whether it fits thousands of times. A bill's
        phases are not changed once built (a changed bill is a new DeviceLedger)."""
        return max(sum(map(int, components.values())) for components in self.phases.values())

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

    def reserved_by_phase(self) -> dict[str, int]:
        """The caching allocator's peak reserved bytes in each phase (a CPU has no such allocator: allocated)."""
        return {ph: self.replayed_reserved.get(ph, total + self._reserve(total)) for ph, total in self._totals()}

    def _totals(self):
        return ((ph, sum(map(int, c.values()))) for ph, c in self.phases.items())

    @property
    def need_bytes(self) -> int:
        """What the device must hold before any margin: the peak allocated plus the runtime."""
        return self.peak_allocated + self.runtime_bytes

    @property
    def margin_bytes(self) -> int:
        """Kept free on top of the need: the plan's accuracy band and the caching allocator's reserve."""
        return self.error_margin_bytes + self.reserve_bytes

    def margin_json(self) -> dict:
        return {
            "total_bytes": self.margin_bytes,
            "accuracy_bytes": self.error_margin_bytes,
            "accuracy_fraction": self.error_band,
            "accuracy_source": self.error_band_source,
            "allocator_bytes": self.reserve_bytes,
            "allocator_fraction": self.reserve_fraction,
            "allocator_source": self.reserve_source,
        }

    @property
    def fits(self) -> bool:
        """FITS: the headroom covers the margin (plan/verdict.py has the other two states)."""
        return self.headroom_bytes >= 0

    @property
    def state(self) -> str:
        from trainplan.plan.verdict import device_state

        return device_state(self)

    def why_parts(self, component: str) -> tuple[tuple[str | None, int], ...]:
        """The terms of a component's figure at the peak (plan/phase.Bytes); None: the note's own term."""
        return parts_of(self.components[component])

    def why_lines(self) -> list[tuple[str, str]]:
        """(component, its why with its figure and, where it has several, every term) at the peak."""
        out = []
        for c in COMPONENTS:
            figure = self.components[c]
            if not figure or c not in self.explain:
                continue
            text = f"{gib(figure)}: {self.explain[c]}"
            parts = self.why_parts(c)
            if parts != ((None, figure),):
                terms = [f"{gib(abs(n))} {label or 'of these'}" for label, n in parts]
                signs = ["- " if n < 0 else "+ " for _, n in parts]
                text += "; the terms: " + " ".join(s + t for s, t in zip(signs, terms, strict=True)).removeprefix("+ ")
            out.append((c, text))
        return out

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
            "need_bytes": self.need_bytes,
            "reserved_bytes": self.reserved_by_phase(),
            "allocator_mode": self.allocator_mode if self.device.kind != "cpu" else None,
            "margin": self.margin_json(),
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "state": self.state,
            "largest_component": self.largest_component,
            "explain": self.explain,
            "why": {
                c: [{"term": label or "as explained", "bytes": n} for label, n in self.why_parts(c)]
                for c in COMPONENTS
                if self.components[c]
            },
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
    # whether `trainplan train` runs this layout as planned (plan/analytic.py `runnable`)
    runnable: dict = field(default_factory=lambda: {"ok": True, "why": ""})
    # under TIGHT or DOES NOT FIT, the nearest change that fits (advise/nearest.py): {"text", ...}
    next_step: dict | None = None
    # `plan --data`: the training split as train packs it and the run's widest micro-batch (plan/from_data.py)
    data: dict | None = None

    @property
    def all_ledgers(self) -> list[DeviceLedger]:
        return self.devices + ([self.host] if self.host else [])

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.all_ledgers)

    def judge(self):
        """The verdict (plan/verdict.py): FITS / TIGHT / DOES NOT FIT, its summary and margin."""
        from trainplan.plan.verdict import verdict

        return verdict(self)

    @property
    def state(self) -> str:
        return self.judge().state

    def exit_code_for(self, *, strict: bool = False) -> int:
        return self.judge().exit_code(strict=strict)

    @property
    def exit_code(self) -> int:
        return self.exit_code_for()

    def verdict(self) -> str:
        return self.judge().summary

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "source": self.source,
            "model": self.model,
            "settings": self.settings,
            "devices": [d.to_json() for d in self.devices],
            "host": self.host.to_json() if self.host else None,
            "runnable": self.runnable,
            "next_step": self.next_step,
            "verdict": {
                **self.judge().to_json(),
                "overflows": [
                    {
                        "label": d.label,
                        "device": d.device.name,
                        "state": d.state,
                        "over_bytes": -d.headroom_bytes,
                        "component": d.largest_component,
                        "phase": d.peak_phase,
                    }
                    for d in self.all_ledgers
                    if not d.fits
                ],
            },
            "notes": self.notes,
            **({"data": self.data} if self.data is not None else {}),
        }


def plan_only_text(ledger: Ledger) -> str:
    return f"PLAN ONLY: `trainplan train` does not run this layout: {ledger.runnable['why']}"


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


_STATE_CELL = {
    "FITS": ("fits", "green"),
    "TIGHT": ("TIGHT", "bold yellow"),
    "DOES NOT FIT": ("DOES NOT FIT", "bold red"),
}


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
    t.add_row("verdict", *(cell(*_STATE_CELL[d.state]) for _, d in cols))
    width = columns(terminal)
    head = (
        f"trainplan plan — {ledger.model['name']} ({ledger.model['params'] / 1e6:,.1f}M params), "
        f"{ledger.settings['summary']}"
    )
    first = cols[0][1]
    why = [f"Why ({first.label}, {first.peak_phase} peak):"]
    if first.peak_phase in first.explain and first.peak_phase not in COMPONENTS:  # a phase's own note
        why.append(wrap(f"{first.peak_phase}: {first.explain[first.peak_phase]}", indent="  ", width=width))
    why += [wrap(f"{c} {text}", indent="  ", width=width) for c, text in first.why_lines()]
    out = [wrap(head, width=width), "", render(t, terminal=terminal), "", wrap(ledger.verdict(), width=width), ""]
    if ledger.next_step:
        out += [wrap(ledger.next_step["text"], width=width), ""]
    if not ledger.runnable["ok"]:
        out += [wrap(plan_only_text(ledger), width=width), ""]
    if ledger.data is not None:
        first, *rest = data_lines(ledger.data)
        out += [wrap(first, width=width), *(wrap(line, indent="  ", hang="  ", width=width) for line in rest), ""]
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
    if ledger.next_step:
        out += [ledger.next_step["text"], ""]
    if not ledger.runnable["ok"]:
        out += [plan_only_text(ledger), ""]
    first = cols[0][1]
    out += [f"- **{c}** {text}" for c, text in first.why_lines()]
    if ledger.notes:
        out += [""] + [f"> {n}" for n in ledger.notes]
    return "\n".join(out) + "\n"


def data_lines(prof: dict) -> list[str]:
    """What the ledger prints of `plan --data`'s figures (plan/from_data.py)."""
    t, w = prof["document_tokens"], prof["widest"]
    lines = [
        f"From the data: {prof['documents']:,} training documents, tokens per document p50 {t['p50']:,} / "
        f"p90 {t['p90']:,} / p99 {t['p99']:,} / max {t['max']:,}",
        f"{prof['packing']} packing: {prof['sequences']:,} rows of {'up to ' if prof['packing'] == 'none' else ''}"
        f"{prof['row_tokens']:,} tokens, {prof['packing_efficiency']:.0%} of the slots real tokens, "
        f"{prof['tokens_per_epoch']:,} tokens an epoch, {prof['truncated_documents']:,} document(s) cut",
        f"widest micro-batch: step {w['step']} of {prof['steps']:,} (micro-batch {w['micro_batch']}, rank "
        f"{w['rank']}): {w['shape'][0]} x {w['shape'][1]:,} tokens",
    ]
    return lines
