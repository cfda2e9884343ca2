"""`advise --maximize seq|micro-batch`: per rung of the ladder, the longest sequence (or the largest
micro-batch) whose plan fits every device.

Found with the analytic planner, never by trial OOM: a candidate fits when `plan()`'s ledger fits on
every device (memory never pools). Memory grows with the sequence length and with the micro-batch,
so fit is treated as monotone along each axis: the search plans the two smallest values, extrapolates
each device's bill linearly to its usable capacity for a first guess, gallops from that guess
(steps 1, 2, 4, ... candidates) until the answer is bracketed, then bisects. A rung that does not fit
at the smallest value costs one plan; one whose bill is linear in the axis about four.

The answer always fits and the next candidate up never does: both are planned. Should the bill ever
fall as the axis grows (it does not in today's terms), a longer sequence could fit beyond a failing
one; the search treats fit as monotone and reports the first boundary it brackets, which still
holds that guarantee.

Sequence lengths are multiples of SEQ_STEP tokens (and the model's context itself when that is not
one), up to the model's context: `resolve` refuses a longer sequence unless model.extend_context is
set, and then the search stops at MAX_EXTENDED_SEQ. Micro-batches: every integer up to MAX_MICRO
(global batch = micro-batch x data-parallel degree, no accumulation), or, with --global-batch, the
divisors of the per-replica batch up to search.MAX_MICRO_BATCH, as the ordinary search uses.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from trainplan import config as C
from trainplan import startup
from trainplan.advise.estimate import StepEstimate, estimate
from trainplan.advise.rank import fit_margin, peak_json, rung_json
from trainplan.advise.search import MAX_MICRO_BATCH, Request, Rung, micro_batches, overflow, peak_fraction, rungs
from trainplan.errors import ConfigError
from trainplan.plan.analytic import plan, resolve
from trainplan.plan.ledger import Ledger
from trainplan.spec.devices import DeviceSpec, parse_devices

AXES = ("seq", "micro-batch")
SEQ_STEP = 256  # tokens: the granularity of the longest context
MAX_EXTENDED_SEQ = 1 << 23  # with model.extend_context the model sets no cap; the search stops here (8M tokens)
CP_DEGREES = (2, 4, 8, 16, 32, 64)  # context parallelism's degrees the seq search adds, up to the dp ranks
MAX_MICRO = 1024  # without --global-batch: how far the micro-batch search looks

SCHEMA = "trainplan.advise.maximize/1"


@dataclass(kw_only=True)
class Longest:
    """One rung's answer: the largest value on the axis that fits, with its ledger and estimate."""

    rung: Rung
    values: list[int]  # the candidates, ascending
    value: int = 0  # the largest that fits; 0: not even the smallest
    config: C.RunConfig | None = None  # at value
    ledger: Ledger | None = None  # at value; when nothing fits, at the smallest candidate
    over: tuple[int, Ledger | str] | None = None  # the next candidate up: its ledger or the planner's refusal
    refused: str = ""  # the planner refused the smallest candidate
    estimate: StepEstimate | None = None

    @property
    def fits(self) -> bool:
        return self.value > 0

    @property
    def capped(self) -> bool:
        """The largest candidate fits: the cap, not memory, is the limit."""
        return self.fits and self.value == self.values[-1]


@dataclass(kw_only=True)
class Maximized:
    request: Request
    axis: str
    devices: list[DeviceSpec]
    micro_batch: int  # seq axis: the fixed micro-batch
    global_batch: int | None  # None: micro-batch axis without --global-batch (accumulation 1)
    cap: int  # the largest candidate value
    cap_reason: str  # what sets the cap, as the report says it
    results: list[Longest]  # ladder order
    evaluated: int
    seconds: float
    ranked: list[Longest] = field(default_factory=list)  # those that fit, longest first, ladder order on ties


def seq_cap(request: Request) -> tuple[int, str]:
    """(the longest sequence the model takes, why): its learned positions, else its context unless
    model.extend_context is set (resolve refuses the rest), else the search's own limit."""
    spec = request.spec
    if spec.learned_positions:
        return spec.learned_positions, f"the model's {spec.learned_positions:,} learned positions"
    if not request.base.model.extend_context:
        return spec.max_position_embeddings, f"the model's context ({spec.max_position_embeddings:,} tokens)"
    return MAX_EXTENDED_SEQ, f"the search's limit of {MAX_EXTENDED_SEQ:,} tokens (model.extend_context is set)"


def seq_values(cap: int) -> list[int]:
    """Multiples of SEQ_STEP up to the cap, and the cap itself when it is not one."""
    values = list(range(SEQ_STEP, cap + 1, SEQ_STEP))
    return values + [cap] if not values or values[-1] != cap else values


class _Probe:
    """plan() for one rung at one value of the axis, memoized and counted."""

    def __init__(self, m: Maximized):
        self.m, self.evaluated = m, 0
        self._seq: list[int] | None = None
        self._base: dict[Rung, C.RunConfig] = {}
        self._ledgers: dict[tuple[Rung, int], Ledger | str] = {}

    def values(self, rung: Rung) -> list[int]:
        m = self.m
        if m.axis == "seq":  # every rung's the same: made once (8M tokens is 31,250 of them)
            if self._seq is None:
                self._seq = seq_values(m.cap)
            return self._seq
        if m.global_batch is None:
            return list(range(1, MAX_MICRO + 1))
        return micro_batches(m.global_batch // rung.dp)

    def config(self, rung: Rung, value: int) -> C.RunConfig:
        m = self.m
        cfg = self._base.get(rung)
        if cfg is None:
            cfg = self._base[rung] = rung.config(m.request.base, 1, m.request.global_batch)
        if m.axis == "seq":
            batch = C.BatchConfig(micro_batch_size=m.micro_batch, global_batch_size=m.global_batch, seq_len=value)
        else:
            g = m.global_batch if m.global_batch is not None else value * rung.dp
            batch = C.BatchConfig(micro_batch_size=value, global_batch_size=g, seq_len=cfg.batch.seq_len)
        return replace(cfg, batch=batch)

    def __call__(self, rung: Rung, value: int) -> Ledger | str:
        key = (rung, value)
        if key not in self._ledgers:
            self.evaluated += 1
            try:
                self._ledgers[key] = plan(self.config(rung, value), self.m.request.spec)
            except ConfigError as e:  # refused at this value (e.g. a sequence the model does not take)
                self._ledgers[key] = str(e)
        return self._ledgers[key]


def headroom(ledger: Ledger | str) -> float:
    """The fullest device's headroom in bytes (< 0: does not fit); -inf for a refused candidate."""
    if isinstance(ledger, str):
        return -math.inf
    return min(d.headroom_bytes for d in ledger.all_ledgers)


def _secant(a: tuple[int, float], b: tuple[int, float]) -> float | None:
    """Where the line through (value, headroom) points a and b crosses zero; None when it never
    does ahead (the bill does not grow between them) or a headroom is unknown."""
    (va, ha), (vb, hb) = a, b
    if not (math.isfinite(ha) and math.isfinite(hb)) or ha <= hb:
        return None
    return va + ha * (vb - va) / (ha - hb)


def largest(values: list[int], room: Callable[[int], float]) -> int:
    """The index of the largest value whose headroom `room(i)` is >= 0, given that values[0] fits,
    treating fit as monotone in the value. Each probe aims where the headroom, interpolated linearly
    through the bracketing points (extrapolated from the last two that fit until one does not),
    crosses zero; a probe that does not halve the bracket is followed by a bisection, so it never
    takes more than about twice the probes of a plain binary search (an exponential probe while
    nothing above fails and the bill does not grow). The index returned was probed and fits; the
    one after it, when there is one, was probed and does not."""
    n = len(values)
    lo, hi = 0, n  # invariant: room(lo) >= 0; hi == n or room(hi) < 0
    known = {0: room(0)}
    below: int | None = None  # the fitting probe before lo
    bisect_next = False
    while hi - lo > 1:
        width = hi - lo
        if bisect_next and hi < n:
            i = (lo + hi) // 2
        else:
            if hi < n:
                cross = _secant((values[lo], known[lo]), (values[hi], known[hi]))
            else:
                cross = None if below is None else _secant((values[below], known[below]), (values[lo], known[lo]))
            if cross is None:
                i = (lo + hi) // 2 if hi < n else 2 * lo + 1  # no estimate: bisect, or double the index
            else:
                i = bisect.bisect_right(values, cross) - 1
            i = min(max(i, lo + 1), hi - 1)
        known[i] = room(i)
        if known[i] >= 0:
            below, lo = lo, i
        else:
            hi = i
        bisect_next = hi - lo > width // 2
    return lo


def _longest(probe: _Probe, rung: Rung) -> Longest:
    values = probe.values(rung)
    out = Longest(rung=rung, values=values)
    first = probe(rung, values[0])
    if isinstance(first, str):
        out.refused = first
        return out
    out.ledger = first
    if not first.fits:
        return out
    i = largest(values, lambda j: headroom(probe(rung, values[j])))
    out.value, out.config, out.ledger = values[i], probe.config(rung, values[i]), probe(rung, values[i])
    if i + 1 < len(values):
        out.over = (values[i + 1], probe(rung, values[i + 1]))
    return out


def long_context(ladder: list[Rung], request: Request, devices: list[DeviceSpec]) -> list[Rung]:
    """The rungs a long sequence needs beyond the ladder (issue 67), each after the rung it extends: context
    parallelism over cp of the data-parallel ranks (alone on the model's axes; cp dividing the heads as the
    engine splits them), and on a checkpointed rung the tiled MLP with the checkpoints in host memory, where
    hardware.host_mem says how much there is."""
    spec, host = request.spec, request.base.hardware.host_mem
    out = []
    for rung in ladder:
        if rung.mode == "inference":
            continue
        degrees = [1]
        if rung.tp == rung.pp == 1:
            kv = spec.num_kv_heads
            for cp in CP_DEGREES:
                if rung.dp % cp == 0 and spec.num_heads % cp == 0 and (kv % cp == 0 or cp % kv == 0):
                    if request.global_batch is None or request.global_batch % (rung.dp // cp) == 0:
                        degrees.append(cp)
        tiled = [False] + ([True] if rung.ac and host and not spec.mlp.num_experts and spec.layer_fit is None else [])
        # a full fine-tune's ZeRO-3 with its shards and optimizer in host memory (ALST's single-GPU layout)
        hosted = [False] + ([True] if rung.mode == "full" and host and rung.strategy in ("ddp", "zero3") else [])
        for cp in degrees:
            for long in tiled:
                for on_host in hosted:
                    if cp == 1 and not long and not on_host:
                        continue  # the ladder's own rung
                    strategy = rung.strategy if rung.dp > 1 else ("ddp" if cp == 1 else "zero3")
                    out.append(
                        replace(
                            rung,
                            cp=cp,
                            strategy="zero3" if on_host else strategy,
                            tiled=long,
                            offload_checkpoints=long,
                            host_optimizer=on_host,
                            key=(*rung.key, cp, long, on_host),
                        )
                    )
    return out


def maximize(request: Request, axis: str, *, micro_batch: int = 1, fixed_global_batch: bool = True) -> Maximized:
    """Per rung of the ladder, the largest value of `axis` ("seq" or "micro-batch") that fits every
    device; those that fit ranked longest first, ladder order on ties, each with its estimate.
    `micro_batch`: the fixed micro-batch of the seq axis; `fixed_global_batch`: False lets the
    micro-batch axis set the global batch (micro-batch x data-parallel degree, no accumulation)."""
    assert axis in AXES, axis
    t0 = time.perf_counter()
    global_batch = request.global_batch if axis == "seq" or fixed_global_batch else None
    devices = parse_devices(request.base.hardware.gpus, request.base.hardware.gpu_mem)
    if axis == "seq":
        cap, reason = seq_cap(request)
    elif global_batch is None:
        cap, reason = MAX_MICRO, f"the search's limit of {MAX_MICRO:,}"
    else:
        cap = min(global_batch, MAX_MICRO_BATCH)
        reason = f"the per-replica batch (global batch {global_batch} / dp, at most {cap})"
    m = Maximized(
        request=request,
        axis=axis,
        devices=devices,
        micro_batch=micro_batch,
        global_batch=global_batch,
        cap=cap,
        cap_reason=reason,
        results=[],
        evaluated=0,
        seconds=0.0,
    )
    probe = _Probe(m)
    ladder = rungs(request.spec, devices, request.modes, request.global_batch)
    if axis == "seq":
        ladder += long_context(ladder, request, devices)
    with startup.paused():
        m.results = [_longest(probe, r) for r in ladder]
    m.ranked = sorted((x for x in m.results if x.fits), key=lambda x: (-x.value, x.rung.key))
    for x in m.ranked:
        x.estimate = estimate(resolve(x.config, request.spec), request.calibration)
    m.evaluated, m.seconds = probe.evaluated, time.perf_counter() - t0
    return m


# ---- output ----------------------------------------------------------------------------------


def unit(m: Maximized) -> str:
    return "seq" if m.axis == "seq" else "micro-batch"


def limit_text(m: Maximized, x: Longest) -> str:
    """Why the answer is not larger: the cap, or the next candidate's overflow (or refusal)."""
    if x.capped and m.axis == "micro-batch" and m.global_batch is not None:
        per_replica = m.global_batch // x.rung.dp
        if x.value == per_replica:
            return f"the per-replica batch ({m.global_batch} / dp {x.rung.dp}), not memory, is the limit"
        return f"the search's limit of {MAX_MICRO_BATCH} (a divisor of the per-replica batch {per_replica})"
    if x.capped:
        return f"{m.cap_reason}, not memory, is the limit"
    value, over = x.over
    if isinstance(over, str):
        return f"at {unit(m)} {value:,} the planner refuses it: {over}"
    return f"at {unit(m)} {value:,}: {overflow(over)}"


def entry_json(m: Maximized, x: Longest, rank: int) -> dict:
    r, b, est = x.rung, x.config.batch, x.estimate
    return {
        "rank": rank,
        "rung": r.short(),
        **rung_json(r),
        "activation_checkpointing": r.ac,
        "optimizer": r.optimizer,
        "lora": {"r": r.lora_r, "targets": r.targets_label} if r.lora_r else None,
        "seq_len": b.seq_len,
        "micro_batch_size": b.micro_batch_size,
        "global_batch_size": b.global_batch_size,
        "grad_accum_steps": x.ledger.settings["grad_accum_steps"],
        "capped": x.capped,
        "limit": limit_text(m, x),
        "peak": peak_json(x.ledger),
        "estimate": None
        if est is None
        else {"step_seconds": est.step_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu},
    }


def nothing_fits(m: Maximized) -> str:
    """One line: nothing fits at the smallest value, and the closest rung's overflow."""
    at = f"{unit(m)} {m.results[0].values[0]:,}" if m.results else unit(m)
    planned = [x for x in m.results if x.ledger is not None]
    if not planned:
        refused = next((x.refused for x in m.results if x.refused), "no layout")
        return f"NOTHING FITS even at {at}: no candidate could be planned: {refused}"
    closest = min(planned, key=lambda x: peak_fraction(x.ledger))
    return f"NOTHING FITS even at {at}: the closest, {closest.rung.short()}, exceeds {overflow(closest.ledger)}"


def render_text(m: Maximized, doc: dict, *, terminal: bool = False) -> str:
    from trainplan.text import columns, render, table, wrap

    req, width = m.request, columns(terminal)
    fixed = (
        f"micro-batch {m.micro_batch}, global batch {m.global_batch}"
        if m.axis == "seq"
        else f"seq {req.base.batch.seq_len}, "
        + (f"global batch {m.global_batch}" if m.global_batch else "global batch = micro-batch x data-parallel degree")
    )
    out = [
        wrap(
            f"trainplan advise --maximize {m.axis} — {req.spec.name} ({req.spec.num_params / 1e6:,.1f}M params) on "
            f"{doc['devices']}, {fixed}, mode {doc['request']['mode']}; up to {m.cap_reason}",
            width=width,
        ),
        wrap(
            f"searched {doc['rungs']} rungs: {doc['evaluated']:,} plans in {doc['seconds']:.2f} s; "
            f"{doc['fit']} FIT every device{fit_margin(doc['request']['margin'])}",
            width=width,
        ),
        "",
    ]
    if not doc["fit"]:
        return "\n".join(out + [wrap(doc["nothing_fits"], width=width)])
    head = "longest seq>" if m.axis == "seq" else "largest\nmicro-batch>"
    t = table("#>", "rung", head, "peak / usable\n(GiB)", "step\n(est.)>", "tokens/s\n(est.)>")
    for e in doc["entries"]:
        est = e["estimate"] or {}
        step, tps = est.get("step_seconds"), est.get("tokens_per_s")
        t.add_row(
            str(e["rank"]),
            e["rung"],
            f"{e['seq_len'] if m.axis == 'seq' else e['micro_batch_size']:,}",
            f"{e['peak']['total_bytes'] / (1 << 30):.1f} / {e['peak']['usable_bytes'] / (1 << 30):.1f} "
            f"{e['peak']['device']}",
            "n/a" if step is None else (f"{step * 1e3:.0f} ms" if step < 1 else f"{step:.2f} s"),
            f"{tps:,.0f}" if tps else "n/a",
        )
    out.append(render(t, terminal=terminal))
    if doc["fit"] > len(doc["entries"]):
        out.append(f"... and {doc['fit'] - len(doc['entries'])} more that fit (--top 0 shows all)")
    out += ["", "limit:"] + [wrap(f"{e['rank']:>2}  {e['limit']}", indent="  ", width=width) for e in doc["entries"]]
    out += ["", wrap(doc["estimate_note"], width=width)]
    out += [wrap("note: " + n, width=width) for n in doc["notes"]]
    if doc["out"]:
        out.append(wrap(f"wrote {doc['out']['path']} (row 1 of {doc['out']['of']}); run it: {doc['out']['run']}"))
    return "\n".join(out)


def out_toml(m: Maximized, x: Longest, row: int, of: int, launch: str, weights_note: list[str]) -> str:
    """The entry's config as TOML, with comment lines saying how it was found and how to run it."""
    b = x.config.batch
    header = [
        f"# trainplan advise --maximize {m.axis}: {m.request.spec.name}, row {row} of {of}",
        f"# {x.rung.short()}; seq {b.seq_len}, micro-batch {b.micro_batch_size}, global batch {b.global_batch_size}",
        f"# the largest {unit(m)} that fits every device; {limit_text(m, x)}",
        f"# run: {launch}",
    ]
    return "\n".join(header + weights_note) + "\n" + C.to_toml(x.config)
