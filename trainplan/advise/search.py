"""The memory ladder: search configurations with the analytic planner, keep those that fit every device.

Each candidate is a RunConfig planned with `plan()`; whether it fits is the ledger's per-device
verdict with a safety margin, never pooled memory. A rung is every setting except the micro-batch:
it fits when micro-batch 1 fits. Memory grows with the micro-batch, so a binary search over the
divisors of the per-replica batch finds the largest that fits; the one shown is the fastest of those.

The ladder, least intrusive first (the most significant knob first):
  mode full -> LoRA -> QLoRA; for LoRA, all linear layers before attention only, rank 64 -> 16;
  precision mixed (bf16 where every device has it) -> pure bf16; AdamW -> 8-bit AdamW;
  no model parallelism -> tensor -> pipeline; no checkpointing -> checkpointing;
  DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 (FSDP), ZeRO-2 in the form `train` runs: FSDP2 without resharding
  after forward (fsdp-grad-op: the gradients and optimizer states sharded, the parameters gathered from
  forward through backward), not DeepSpeed's replicated parameters (zero2, planned but not run).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field, replace

from trainplan import config as C
from trainplan import features, startup
from trainplan.advise.estimate import StepEstimate, estimate
from trainplan.errors import ConfigError
from trainplan.plan.analytic import fits_resolved, plan_resolved
from trainplan.plan.ledger import DeviceLedger, Ledger, gib
from trainplan.resolve import Resolved, resolve
from trainplan.spec.devices import CATALOG, DeviceSpec, parse_devices
from trainplan.spec.model import ModelSpec
from trainplan.spec.parallel import resolve_batch

TRAIN_MODES = ("full", *features.lora.ADAPTER_MODES)
# ZeRO-1/2 would shard only a LoRA adapter's tiny states; inference replicas hold no training state
STRATEGIES = {
    "full": ("ddp", "zero1", "fsdp-grad-op", "zero3"),
    "lora": ("ddp", "zero3"),
    features.qlora.MODE: ("ddp", "zero3"),
    "inference": ("ddp",),
}
LORA_RANKS = (64, 16)  # QLoRA's r=64 (Dettmers et al. 2023) and a common smaller default
TP_DEGREES = (1, 2, 4, 8)  # tensor parallelism stays inside one 8-GPU node
PP_DEGREES = (1, 2, 4, 8, 16)
MAX_MICRO_BATCH = 64
MAX_DEVICES = 512  # how far "what would be needed" looks
NAMES = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "fsdp-grad-op": "ZeRO-2 (FSDP2 grad-op)",
    "zero3": "ZeRO-3/FSDP",
    "full": "full fine-tuning",
    "lora": "LoRA",
    features.qlora.MODE: "QLoRA",
    "inference": "inference",
    "adamw": "AdamW",
    features.optim8bit.NAME: "8-bit AdamW",
}


@dataclass(frozen=True, kw_only=True)
class Rung:
    """Every setting of a candidate but its micro-batch."""

    mode: str
    precision: str
    optimizer: str
    tp: int
    pp: int
    dp: int
    ac: bool
    strategy: str  # ddp at dp 1, where the planner calls it "single"
    lora_r: int = 0
    lora_targets: tuple[str, ...] = ()
    targets_label: str = ""  # all-linear | attention
    # the long-context rungs (advise --maximize seq, advise/maximize.py `long_context`): context parallelism
    # over cp of the dp ranks, the tiled MLP, and the checkpointed layers' inputs in host memory
    cp: int = 1
    tiled: bool = False  # memory.tiled_mlp
    offload_checkpoints: bool = False
    host_optimizer: bool = False  # ZeRO-3 with the parameter shards and the optimizer in host memory
    key: tuple = field(default=(), compare=False)  # position on the ladder

    def config(self, base: C.RunConfig, micro_batch: int, global_batch: int) -> C.RunConfig:
        lora = base.lora
        if self.lora_r:
            lora = replace(lora, r=self.lora_r, alpha=2.0 * self.lora_r, target_modules=list(self.lora_targets))
        return replace(
            base,
            mode=self.mode,
            precision=self.precision,
            optim=replace(base.optim, name=self.optimizer),
            batch=C.BatchConfig(
                micro_batch_size=micro_batch, global_batch_size=global_batch, seq_len=base.batch.seq_len
            ),
            parallel=C.ParallelConfig(
                strategy=self.strategy, tp=self.tp, pp=self.pp, cp=self.cp, **self._on_host("offload_optimizer")
            ),
            memory=replace(
                base.memory,
                activation_checkpointing=self.ac,
                **({"tiled_mlp": True} if self.tiled else {}),
                **({"offload_activations": True} if self.offload_checkpoints else {}),
            ),
            lora=lora,
        )

    def _on_host(self, field: str) -> dict:
        """The setting of a long-context rung that puts the optimizer on the host (features/optimizer_offload)."""
        return {field: True} if self.host_optimizer else {}

    def short(self) -> str:
        """'LoRA r16 all-linear, amp-bf16, ZeRO-3/FSDP, checkpointing, tp 2'."""
        parts = [NAMES[self.mode] + (f" r{self.lora_r} {self.targets_label}" if self.lora_r else "")]
        parts.append(self.precision)
        if self.dp > 1:
            parts.append(NAMES[self.strategy])
        if self.ac:
            parts.append("checkpointing")
        if self.optimizer != "adamw" and self.mode != "inference":
            parts.append(NAMES[self.optimizer])
        parts += (
            [f"tp {self.tp}"] * (self.tp > 1) + [f"pp {self.pp}"] * (self.pp > 1) + [f"cp {self.cp}"] * (self.cp > 1)
        )
        parts += ["tiled MLP"] * self.tiled + ["checkpoints in host memory"] * self.offload_checkpoints
        parts += ["optimizer in host memory"] * self.host_optimizer
        return ", ".join(parts)


@dataclass(kw_only=True)
class Outcome:
    rung: Rung
    base: Ledger | None = None  # at micro-batch 1: always planned for a rung that does not fit
    refused: str = ""  # the planner refused the config (ConfigError)
    largest_micro: int = 0  # the largest micro-batch that fits; 0: none
    over: tuple[int, Ledger] | None = None  # the next micro-batch up, which did not fit
    best_micro: int = 0  # the one shown: the fastest estimate among those that fit, the largest on a tie
    best: Ledger | None = None
    estimate: StepEstimate | None = None
    micro_options: list[int] = field(default_factory=list)  # divisors of the per-replica batch
    ledgers: dict[int, Ledger] = field(default_factory=dict, repr=False)  # micro-batch -> planned ledger
    checked: dict[int, bool] = field(default_factory=dict, repr=False)  # micro-batch -> fits (not all planned)

    @property
    def fits(self) -> bool:
        """Fits at micro-batch 1 (so at every micro-batch up to largest_micro)."""
        return self.largest_micro > 0


@dataclass(kw_only=True)
class Request:
    base: C.RunConfig  # model, hardware, seq_len and margin set; the rest is searched
    spec: ModelSpec
    modes: tuple[str, ...]
    global_batch: int
    calibration: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Search:
    request: Request
    devices: list[DeviceSpec]
    outcomes: list[Outcome]  # ladder order
    planner: _Planner
    seconds: float
    skipped_layouts: list[str]

    @functools.cached_property
    def by_rung(self) -> dict[Rung, Outcome]:
        return {o.rung: o for o in self.outcomes}

    @property
    def evaluated(self) -> int:
        """Candidate configurations planned so far (each a full plan() call)."""
        return self.planner.evaluated


# ---- the candidates --------------------------------------------------------------------------


def precisions(devices: list[DeviceSpec], mode: str) -> tuple[str, ...]:
    """Mixed precision, bf16 where every device has it. CPUs have no tensor cores: fp32 is no slower."""
    if any(d.kind == "cpu" for d in devices):
        return ("fp32", "bf16") if mode == "inference" else ("fp32", "amp-bf16", "bf16")
    bf16 = all(d.bf16 for d in devices)
    if mode == "inference":
        return ("bf16",) if bf16 else ("amp-fp16",)
    return ("amp-bf16", "bf16") if bf16 else ("amp-fp16", "fp32")


def layouts(spec: ModelSpec, devices: list[DeviceSpec], global_batch: int) -> tuple[list, list[str]]:
    """(tp, pp, dp) that divide the devices and the model, and whose dp divides the global batch (gloo
    runs tp and pipeline stages on CPU processes too)."""
    world, out, skipped = len(devices), [], []
    for tp in TP_DEGREES:
        if tp > world or spec.num_heads % tp or spec.num_kv_heads % tp:
            continue
        for pp in PP_DEGREES:
            if world % (tp * pp) or pp > spec.num_layers:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                skipped.append(f"tp {tp} x pp {pp} (dp {dp} does not divide the global batch {global_batch})")
                continue
            out.append((tp, pp, dp))
    return out, skipped


def lora_targets(spec: ModelSpec) -> list[tuple[str, tuple[str, ...]]]:
    """All linear layers (QLoRA's recipe, Dettmers et al. 2023) and the attention q/v pair (Hu et al. 2021)."""
    every, attn = spec.lora_modules(["all-linear"]), spec.lora_modules(["attention"])
    return [("all-linear", every)] + ([("attention", attn)] if attn != every else [])


def rungs(spec: ModelSpec, devices: list[DeviceSpec], modes: tuple[str, ...], global_batch: int) -> list[Rung]:
    """Every rung for these devices, in ladder order."""
    gpu = all(d.is_gpu for d in devices)
    found, _ = layouts(spec, devices, global_batch)
    out = []
    for mode_i, mode in enumerate(modes):
        if mode == features.qlora.MODE and not gpu:
            continue  # bitsandbytes' 4-bit kernels need CUDA
        adapters = mode in features.lora.ADAPTER_MODES
        knobs = itertools.product(
            enumerate(lora_targets(spec) if adapters else [("", ())]),
            enumerate(LORA_RANKS if adapters else (0,)),
            enumerate(precisions(devices, mode)[: 1 if adapters else None]),  # a LoRA base is 16-bit anyway
            enumerate(("adamw", features.optim8bit.NAME) if (mode == "full" and gpu) else ("adamw",)),
            found,
            (False,) if mode == "inference" else (False, True),
        )
        for (t_i, (label, mods)), (r_i, r), (p_i, prec), (o_i, opt), (tp, pp, dp), ac in knobs:
            strategies = ("ddp",) if dp == 1 else STRATEGIES[mode]
            for s_i, strategy in enumerate(strategies):
                out.append(
                    Rung(
                        mode=mode,
                        precision=prec,
                        optimizer=opt,
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        ac=ac,
                        strategy=strategy,
                        lora_r=r,
                        lora_targets=mods,
                        targets_label=label,
                        key=(mode_i, t_i, r_i, p_i, o_i, tp * pp, pp, tp, ac, s_i),
                    )
                )
    return sorted(out, key=lambda r: r.key)


def micro_batches(per_replica: int) -> list[int]:
    return [m for m in range(1, min(per_replica, MAX_MICRO_BATCH) + 1) if per_replica % m == 0]


# ---- the search ------------------------------------------------------------------------------


class _Planner:
    """plan() with one shared ModelSpec, counting the candidates it evaluates."""

    def __init__(self, request: Request, gpus: str | None = None):
        self.request, self.evaluated, self.base = request, 0, request.base
        if gpus is not None:  # other devices than requested: what would fit
            self.base = replace(self.base, hardware=replace(self.base.hardware, gpus=gpus, gpu_mem=None))
        self._resolved: dict[tuple[Rung, int], Resolved] = {}
        self._memo: dict[Rung, dict] = {}  # plan_resolved's, per rung: its micro-batches share it

    def resolved(self, rung: Rung, micro_batch: int) -> Resolved:
        """The rung resolved at this micro-batch. Everything but the batch is built and validated
        once per rung: resolve's checks do not depend on the micro-batch, resolve_batch's do."""
        key = (rung, micro_batch)
        if key not in self._resolved:
            if micro_batch == 1:
                cfg = rung.config(self.base, 1, self.request.global_batch)
                self._resolved[key] = resolve(cfg, self.request.spec)
            else:
                r = self.resolved(rung, 1)
                cfg = _changed(r.cfg, batch=_changed(r.cfg.batch, micro_batch_size=micro_batch))
                self._resolved[key] = _changed(r, cfg=cfg, batch=resolve_batch(cfg.batch, r.dims.data_dp))
        return self._resolved[key]

    def __call__(self, rung: Rung, micro_batch: int) -> Ledger:
        self.evaluated += 1
        return self._plan(rung, micro_batch)

    def _plan(self, rung: Rung, micro_batch: int) -> Ledger:
        return plan_resolved(self.resolved(rung, micro_batch), self._memo.setdefault(rung, {}))

    def ledger(self, o: Outcome, micro_batch: int) -> Ledger:
        """The rung's plan at this micro-batch (one candidate, whether checked before or not)."""
        if micro_batch not in o.ledgers:
            self.evaluated += micro_batch not in o.checked
            o.ledgers[micro_batch] = self._plan(o.rung, micro_batch)
        return o.ledgers[micro_batch]

    def fits(self, o: Outcome, micro_batch: int) -> bool:
        """Whether the rung fits at this micro-batch: its plan, stopped at the first device over."""
        if micro_batch in o.ledgers:
            return o.ledgers[micro_batch].fits
        if micro_batch not in o.checked:
            self.evaluated += 1
            r = self.resolved(o.rung, micro_batch)
            o.checked[micro_batch] = fits_resolved(r, self._memo.setdefault(o.rung, {}))
        return o.checked[micro_batch]


def _changed(obj, **fields):
    """A copy of a dataclass already validated, with `fields` changed: dataclasses.replace runs
    __init__ (and its checks) again, which the search would do thousands of times."""
    other = object.__new__(type(obj))
    other.__dict__.update(obj.__dict__, **fields)
    return other


def _climb(planner: _Planner, rung: Rung, top_first: bool) -> Outcome:
    """Find the largest micro-batch that fits, or that micro-batch 1 does not. Memory grows with the
    micro-batch, so a fit at the largest means every smaller one fits, and a failure at 1 means none
    does; in between, a binary search. `top_first`: a rung one step down the ladder (more memory)
    fitted at its largest micro-batch, so this one very likely fits at its largest too: plan it first."""
    ms = micro_batches(planner.request.global_batch // rung.dp)
    out = Outcome(rung=rung, micro_options=ms)
    try:
        if top_first and len(ms) > 1 and planner.fits(out, ms[-1]):
            out.largest_micro = ms[-1]
            return out
        out.base = planner.ledger(out, 1)
    except ConfigError as e:
        out.refused = str(e)
        return out
    if not out.base.fits:
        return out
    if len(ms) == 1 or planner.fits(out, ms[-1]):
        out.largest_micro = ms[-1]
        return out
    lo, hi = 0, len(ms) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if planner.fits(out, ms[mid]):
            lo = mid
        else:
            hi = mid
    out.largest_micro, out.over = ms[lo], (ms[hi], planner.ledger(out, ms[hi]))
    return out


def _choose_micro(planner: _Planner, o: Outcome) -> None:
    """The fastest micro-batch by the estimate (ZeRO-3 gathers once per micro-batch; the pipeline
    bubble shrinks with more of them), the largest on a tie; then its ledger."""
    req = planner.request
    best = None
    for m in o.micro_options:
        if m > o.largest_micro:
            break
        est = estimate(planner.resolved(o.rung, m), req.calibration)
        if best is None or est.step_s is None or best[1].step_s is None or est.step_s <= best[1].step_s:
            best = (m, est)
    o.best_micro, o.estimate = best
    o.best = planner.ledger(o, o.best_micro)
    if o.best_micro != o.largest_micro:
        o.over = None  # the micro-batch was not capped by memory


def search(request: Request) -> Search:
    """Plan every rung of the ladder on the requested devices; estimate the step time of those that fit."""
    t0 = time.perf_counter()
    devices = parse_devices(request.base.hardware.gpus, request.base.hardware.gpu_mem)
    _, skipped = layouts(request.spec, devices, request.global_batch)
    planner = _Planner(request)
    done: dict[Rung, Outcome] = {}
    with startup.paused():
        for rung in rungs(request.spec, devices, request.modes, request.global_batch):
            below = [done.get(r) for _, _, r in _step_backs(rung, devices)]  # earlier on the ladder
            top_first = any(b is not None and b.largest_micro == b.micro_options[-1] for b in below)
            done[rung] = _climb(planner, rung, top_first)
        outcomes = list(done.values())
        for o in outcomes:
            if o.fits:
                _choose_micro(planner, o)
    return Search(
        request=request,
        devices=devices,
        outcomes=outcomes,
        planner=planner,
        seconds=time.perf_counter() - t0,
        skipped_layouts=skipped,
    )


def base_ledger(s: Search, o: Outcome) -> Ledger:
    """The ledger at micro-batch 1, planned now if the search did not need it."""
    if o.base is None:
        o.base = s.planner.ledger(o, 1)
    return o.base


# ---- why: the rung below that failed ---------------------------------------------------------


def worst_device(ledger: Ledger) -> DeviceLedger:
    return min(ledger.all_ledgers, key=lambda d: d.headroom_bytes / d.usable_bytes)


def overflow(ledger: Ledger) -> str:
    """'GPU 0 by 6.10 GiB (largest: optimizer 59.8 GiB)' for the device that is furthest over."""
    d = worst_device(ledger)
    comp = d.largest_component
    return f"{d.label} by {gib(-d.headroom_bytes)} (largest: {comp} {gib(d.components[comp])})"


def peak_fraction(ledger: Ledger) -> float:
    """The fullest device's bill over its usable capacity."""
    return max(d.total_bytes / d.usable_bytes for d in ledger.all_ledgers)


def _step_backs(rung: Rung, devices: list[DeviceSpec]) -> list[tuple[str, str, Rung]]:
    """(what this rung adds, the rung without it named, that rung): one knob stepped back one level."""
    out, world = [], len(devices)
    if rung.mode == features.qlora.MODE:
        out.append(("QLoRA", "LoRA", replace(rung, mode="lora")))
    strategies = STRATEGIES[rung.mode]
    if rung.dp > 1 and strategies.index(rung.strategy) > 0:
        prev = strategies[strategies.index(rung.strategy) - 1]
        out.append((NAMES[rung.strategy], NAMES[prev], replace(rung, strategy=prev)))
    if rung.ac:
        out.append(("checkpointing", "no checkpointing", replace(rung, ac=False)))
    if features.optim8bit.is_8bit(rung.optimizer):
        out.append((NAMES[features.optim8bit.NAME], NAMES["adamw"], replace(rung, optimizer="adamw")))
    precs = precisions(devices, rung.mode)
    if rung.precision in precs and precs.index(rung.precision) > 0:
        prev = precs[precs.index(rung.precision) - 1]
        adds = "pure bf16" if rung.precision == "bf16" else rung.precision
        out.append((adds, prev, replace(rung, precision=prev)))
    for name, degrees in (("tp", TP_DEGREES), ("pp", PP_DEGREES)):
        value = getattr(rung, name)
        if value > 1:
            prev = degrees[degrees.index(value) - 1]
            changed = replace(rung, **{name: prev})
            changed = replace(changed, dp=world // (changed.tp * changed.pp))
            out.append((f"{name} {value}", f"{name} {prev}", changed))
    return out


def why(o: Outcome, s: Search, *, show_micro: bool = True) -> str:
    """One line: what this rung needed over the rung below it that failed, and by how much."""
    needed, spare = [], []
    previous_mode = "full" if o.rung.mode == "lora" else None  # QLoRA steps back to the same LoRA rung
    if previous_mode in s.request.modes:
        lower = [x for x in s.outcomes if x.rung.mode == previous_mode and not x.refused]
        if lower and not any(x.fits for x in lower):  # so each was planned at micro-batch 1
            lean = min(lower, key=lambda x: peak_fraction(x.base))
            needed.append(
                f"{NAMES[o.rung.mode]} needed: {NAMES[previous_mode]} exceeds {overflow(lean.base)} "
                f"even at its leanest ({lean.rung.short()})"
            )
        elif lower:
            spare.append(NAMES[previous_mode] + " fits too")
    for adds, without, rung in _step_backs(o.rung, s.devices):
        below = s.by_rung.get(rung)
        if below is None or below.refused:
            continue
        if below.fits:
            spare.append(f"{without} fits too")
        else:
            needed.append(f"{adds} needed: {without} exceeds {overflow(below.base)}")
    if needed:
        text = "; ".join(needed)
    elif spare:
        text = "not needed for memory: " + ", ".join(spare)
    else:
        d = worst_device(o.best)
        text = f"first rung: fits as it is (least headroom {gib(d.headroom_bytes)} on {d.label})"
    if show_micro and o.over:
        m, led = o.over
        text += f"; micro-batch {o.best_micro}: at {m} {overflow(led)}"
    return text


# ---- nothing fits: what would ------------------------------------------------------------------


def _leanest(candidates: list[Rung]) -> list[Rung]:
    """The most memory-frugal rung of each mode and layout: the last on the ladder among its siblings."""
    last: dict[tuple, Rung] = {}
    for r in candidates:  # ladder order
        last[(r.mode, r.tp, r.pp)] = r
    return list(last.values())


def first_fit(request: Request, gpus: str | None, modes: tuple[str, ...], planner_total: list[int]) -> Rung | None:
    """The first rung on the ladder that fits these devices (None: the requested ones) at micro-batch 1,
    or None. The leanest rung of each mode and layout is tried first: when none of those fits, nothing
    on this ladder does."""
    planner = _Planner(request, gpus)
    devices = parse_devices(planner.base.hardware.gpus, planner.base.hardware.gpu_mem)
    candidates = rungs(request.spec, devices, modes, request.global_batch)
    try:
        if not any(planner(r, 1).fits for r in _leanest(candidates)):
            return None
        return next((r for r in candidates if planner(r, 1).fits), None)
    except ConfigError:
        return None
    finally:
        planner_total[0] += planner.evaluated


def _token(device: DeviceSpec) -> str:
    """The device as parse_devices reads it back and as the advice names it (a card resized by
    --gpu-mem is named by its size)."""
    if device.kind == "cpu" or CATALOG.get(device.name) == device:
        return device.name
    return f"{device.capacity_bytes / (1 << 30):g}GiB"


def what_would_fit(s: Search) -> tuple[str, list[str], int]:
    """(why nothing fits, what would: more devices of this kind, bigger devices, a leaner mode; plans run)."""
    req = s.request
    tried = [o for o in s.outcomes if o.base is not None]
    spent = [0]
    if not tried:
        reason = "no candidate could be planned: " + (s.outcomes[0].refused if s.outcomes else "no layout")
    else:
        closest = min(tried, key=lambda o: peak_fraction(o.base))
        d = worst_device(closest.base)
        reason = (
            f"every candidate exceeds a device (memory does not pool); the closest, {closest.rung.short()}, needs "
            f"{gib(d.total_bytes)} on {d.label} ({d.device.name}, {gib(d.usable_bytes)} usable), over by "
            f"{gib(-d.headroom_bytes)} (largest: {d.largest_component} {gib(d.components[d.largest_component])})"
        )
    smallest = min(s.devices, key=lambda d: d.capacity_bytes)
    count = len(s.devices)
    options = []
    n = count * 2
    while n <= MAX_DEVICES:
        hit = first_fit(req, f"{n}x{_token(smallest)}", req.modes, spent)
        if hit:
            options.append(f">= {n} x {_token(smallest)} ({hit.short()})")
            break
        n *= 2
    if smallest.is_gpu:
        bigger = sorted(
            (d for d in CATALOG.values() if d.capacity_bytes > smallest.capacity_bytes), key=lambda d: d.capacity_bytes
        )
        for dev in bigger:
            hit = first_fit(req, f"{count}x{dev.name}", req.modes, spent)
            if hit:
                options.append(f"{count} x {dev.name} ({hit.short()})")
                break
    leaner = [m for m in TRAIN_MODES if m not in req.modes]
    if req.modes and req.modes[0] != "inference" and leaner:
        lowest = TRAIN_MODES.index(req.modes[-1])
        for mode in leaner:
            if TRAIN_MODES.index(mode) > lowest:
                hit = first_fit(req, None, (mode,), spent)
                if hit:
                    options.append(f"{NAMES[mode]} on {count} x {_token(smallest)} ({hit.short()})")
                    break
    return reason, options, spent[0]
