"""Step-time estimate: compute at an assumed (or measured) MFU, plus the communication the layout adds.

An estimate, not a measurement: FLOPs per step / (peak TFLOP/s x MFU) for compute, bytes on the
wire / nominal link bandwidth for communication. `calibration` replaces the assumed MFU per device
with one measured on real runs (the run registry). Imports no torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import statistics
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from trainplan import config as C
from trainplan.errors import TrainplanError
from trainplan.features import qlora, torch_compile
from trainplan.resolve import Resolved, resolve
from trainplan.spec import devices as D
from trainplan.spec.devices import CATALOG, DeviceSpec, parse_devices
from trainplan.spec.model import ModelSpec, load_model_spec

DEFAULT_MFU = {"cuda": 0.4, "rocm": 0.4, "cpu": 0.2}
QLORA_EFFICIENCY = 0.7  # assumed: NF4 weights are dequantized to bf16 before every matmul
GPUS_PER_NODE = 8  # data parallelism beyond one node crosses the network
INTER_NODE_GBPS = 50.0  # one 400 Gb/s InfiniBand NDR port per GPU (DGX H100 layout)
CPU_LINK_GBPS = 5.0  # assumed: gloo between processes on one host
CPU_CORE_GFLOPS = 96.0  # fp32 per core: 2 AVX2 FMA units x 8 lanes x 2 FLOP x 3 GHz
COMPILED = ", compiled"  # a calibration's key for the device's compiled runs (train.compile): "H100-80GB, compiled"


@dataclass(frozen=True, kw_only=True)
class StepEstimate:
    flops_per_token: float  # model FLOPs of one trained (or inferred) token, recomputation included
    compute_s: float | None  # None: no peak TFLOP/s known for a device
    data_parallel_comm_s: float
    tensor_parallel_comm_s: float
    pipeline_s: float  # send/recv between stages + the 1F1B bubble
    step_s: float | None
    tokens_per_step: int
    mfu: dict[str, float]  # device name -> MFU used
    mfu_source: dict[str, str]  # device name -> "assumed" | "calibrated"

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_s if self.step_s else None


def peak_tflops(device: DeviceSpec, cpu_devices: int = 1) -> float | None:
    """The catalog's dense bf16 figure; for the CPU, a nominal fp32 figure shared by its processes."""
    if device.kind == "cpu":
        return (os.cpu_count() or 1) * CPU_CORE_GFLOPS / 1e3 / cpu_devices
    return device.peak_tflops


def default_mfu(device: DeviceSpec) -> float:
    return DEFAULT_MFU.get(device.kind, DEFAULT_MFU["cuda"])


@functools.lru_cache(maxsize=64)
def matmul_params(spec: ModelSpec) -> int:
    """Parameters a token meets in a matmul: the input embedding is a lookup, not a GEMM (a tied
    embedding is used again as lm_head, so it counts once), norms scale elementwise; MoE counts only
    the routed experts."""
    lookup = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    norms = sum(t.numel for t in spec.tensors if t.role == "norm")
    return spec.active_params_per_token - lookup - spec.learned_positions * spec.hidden_size - norms


def adapter_params(spec: ModelSpec, r: int, targets: list[str]) -> int:
    """LoRA A (r x in) and B (out x r) for every targeted linear layer of every decoder layer (once
    per model, rank and targets: the advisor asks for every candidate)."""
    key = ("adapter_params", r, tuple(targets))
    if key not in spec.memo:
        targets = spec.lora_modules(targets)  # "attention" / "all-linear" expanded, however targets came
        layer_linears = spec.layer_linears
        per_layer = sum(r * (lin.in_features + lin.out_features) for lin in layer_linears if lin.module in targets)
        spec.memo[key] = per_layer * spec.num_layers
    return spec.memo[key]


def flops_per_token(r: Resolved) -> float:
    """Model FLOPs per token, the PaLM convention (Chowdhery et al. 2022, Appendix B).

    Full training: 6N + 12·L·q_dim·S (a forward of 2N + 4·L·q_dim·S for the weight matmuls and the
    two attention matmuls QK^T and AV, and a backward of twice that). LoRA: the frozen weights skip
    their weight-gradient GEMMs, so 4N, plus 6 per adapter parameter; attention has no weights and
    keeps its full backward. Activation checkpointing repeats the forward (of the checkpointed share of
    the layers). Inference: one forward.
    """
    spec, cfg = r.spec, r.cfg
    n = matmul_params(spec)
    attn_fwd = 4 * spec.num_layers * spec.q_dim * r.batch.seq_len
    if cfg.mode == "inference":
        return 2 * n + attn_fwd
    if cfg.mode == "full":
        fwd, total = 2 * n + attn_fwd, 6 * n + 3 * attn_fwd
    else:
        n_adapter = adapter_params(spec, cfg.lora.r, cfg.lora.target_modules)
        fwd = 2 * n + 2 * n_adapter + attn_fwd
        total = 4 * n + 6 * n_adapter + 3 * attn_fwd
    return total + fwd * r.checkpointed_layers // spec.num_layers  # the checkpointed layers' forward, again


def _link_gbps(device: DeviceSpec, world: int, *, cross_node: bool) -> float | None:
    if device.kind == "cpu":
        return CPU_LINK_GBPS
    if device.link_gbps is None:
        return None
    return min(device.link_gbps, INTER_NODE_GBPS) if cross_node and world > GPUS_PER_NODE else device.link_gbps


def data_parallel_bytes(r: Resolved) -> float:
    """Bytes each rank sends per optimizer step for data parallelism (ring collectives: all-reduce
    2(n-1)/n, reduce-scatter and all-gather (n-1)/n of the buffer; NCCL's bus-bandwidth convention).

    DDP / ZeRO-1: one all-reduce of the gradients per step (Rajbhandari et al. 2020, Sec. 7: ZeRO-1
    and -2 move what DP moves). ZeRO-2: the gradient partition cannot hold an unsharded sum, so each
    micro-batch is reduce-scattered; the updated parameters are all-gathered once. ZeRO-3 / FSDP:
    every micro-batch all-gathers the parameters in forward and again in backward and
    reduce-scatters the gradients (1.5x DP). shard-grad-op gathers once per micro-batch.
    """
    dims, prec, cfg = r.dims, r.precision, r.cfg
    n = dims.dp
    if n == 1 or cfg.mode == "inference":
        return 0.0
    f = (n - 1) / n
    params = r.spec.num_params / (dims.tp * dims.pp)
    if cfg.mode == "full":
        trainable, grad_bytes, param_bytes = params, prec.grad_bytes, prec.param_bytes
    else:
        trainable = adapter_params(r.spec, cfg.lora.r, cfg.lora.target_modules) / (dims.tp * dims.pp)
        grad_bytes = param_bytes = 4
    accum = r.batch.grad_accum_steps
    gathered = params * prec.compute_bytes
    if dims.keeps_grad_buckets:  # ddp, zero1: one all-reduce of the gradients per step
        return 2 * f * trainable * grad_bytes
    if dims.keeps_grad_partition:  # zero2: a reduce-scatter per micro-batch, the parameters' all-gather
        return accum * f * trainable * grad_bytes + f * trainable * param_bytes
    if dims.reshard_after_forward:  # zero3: gathered twice (forward, backward) per micro-batch
        return accum * (2 * f * gathered + f * trainable * grad_bytes)
    return accum * (f * gathered + f * trainable * grad_bytes)  # fsdp-grad-op


def tensor_parallel_bytes(r: Resolved) -> float:
    """Megatron TP all-reduces the activations (tokens x hidden) twice per layer in forward and twice
    in backward, twice more under recomputation (Narayanan et al. 2021, Sec. 2.3); per micro-batch."""
    tp = r.dims.tp
    if tp == 1:
        return 0.0
    per_micro = r.batch.micro_batch_size * r.batch.seq_len * r.spec.hidden_size * r.precision.compute_bytes
    passes = 1 if r.cfg.mode == "inference" else 2 + (r.checkpointed_layers / r.spec.num_layers or 0)
    layers = -(-r.spec.num_layers // r.dims.pp)
    return r.batch.grad_accum_steps * layers * 2 * passes * 2 * (tp - 1) / tp * per_micro


class _Devices(NamedTuple):
    """What the step-time estimate takes from the devices, the same for every candidate on them."""

    mfu: tuple[tuple[str, float], ...]  # per device name
    source: tuple[tuple[str, str], ...]  # "calibrated" | "assumed"
    flops_rates: tuple[float | None, ...]  # FLOP/s at that MFU, per device name (None: no peak)
    link_gbps: float | None  # the slowest data-parallel link (None: a device without one)
    tp_link_gbps: float | None  # the slowest link within a node


@functools.lru_cache(maxsize=256)
def _devices(
    devices: tuple[DeviceSpec, ...], world: int, calibration: tuple, qlora: bool, compiled: bool = False
) -> _Devices:
    """compiled: the job runs train.compile, calibrated by the device's compiled runs where there are
    some, else by its eager ones (a compiled step is no slower); an eager job by eager runs only."""
    calibrated = dict(calibration)
    cpu_count = sum(1 for d in devices if d.kind == "cpu")
    mfu, source, rates = {}, {}, []
    for d in {d.name: d for d in devices}.values():
        if compiled and d.name + COMPILED in calibrated:
            mfu[d.name], source[d.name] = calibrated[d.name + COMPILED], "calibrated on compiled runs"
        elif d.name in calibrated:
            mfu[d.name] = calibrated[d.name]
            source[d.name] = "calibrated on eager runs" if compiled else "calibrated"
        else:
            mfu[d.name], source[d.name] = default_mfu(d), "assumed"
        peak = peak_tflops(d, cpu_count)
        eff = mfu[d.name] * (QLORA_EFFICIENCY if qlora else 1.0)
        rates.append(peak * 1e12 * eff if peak else None)
    links = [_link_gbps(d, world, cross_node=True) for d in devices]
    tp_links = [_link_gbps(d, world, cross_node=False) for d in devices]
    missing = None in links or None in tp_links
    return _Devices(
        mfu=tuple(mfu.items()),
        source=tuple(source.items()),
        flops_rates=tuple(rates),
        link_gbps=None if missing else min(links),
        tp_link_gbps=None if missing else min(tp_links),
    )


def estimate(r: Resolved, calibration: dict[str, float] | None = None) -> StepEstimate:
    """Seconds per optimizer step (inference: per forward over the global batch).

    compute = FLOPs per rank / (peak x MFU), on the slowest device; communication for data
    parallelism overlaps with compute (buckets during backward, prefetched all-gathers), so the step
    takes the longer of the two; tensor-parallel all-reduces sit on the critical path and add; the
    1F1B pipeline adds its bubble, (pp - 1) / micro-batches of the compute (Narayanan et al. 2021).
    """
    cfg, dims, batch = r.cfg, r.dims, r.batch
    fpt = flops_per_token(r)
    flops_per_rank = fpt * batch.tokens_per_step / dims.world_size
    calibrated = tuple(sorted((calibration or {}).items()))
    devices = _devices(tuple(r.devices), dims.world_size, calibrated, qlora.on(cfg), torch_compile.active(r))
    mfu, source = dict(devices.mfu), dict(devices.source)
    times = [flops_per_rank / rate if rate else None for rate in devices.flops_rates]
    compute = None if None in times else max(times)
    dp_s = tp_s = pp_s = 0.0
    if dims.world_size > 1 and devices.link_gbps is None:
        compute = None  # a generic GPU: no link bandwidth to estimate with
    elif dims.world_size > 1:
        bw = devices.link_gbps * 1e9
        dp_s = data_parallel_bytes(r) / bw
        tp_s = tensor_parallel_bytes(r) / (devices.tp_link_gbps * 1e9)
        if dims.pp > 1:
            sends = 2 * batch.grad_accum_steps * batch.micro_batch_size * batch.seq_len * r.spec.hidden_size
            pp_s = sends * r.precision.compute_bytes / bw
    step = None
    if compute is not None:
        bubble = compute * (dims.pp - 1) / batch.grad_accum_steps
        pp_s += bubble
        step = max(compute, dp_s) + tp_s + pp_s
    return StepEstimate(
        flops_per_token=fpt,
        compute_s=compute,
        data_parallel_comm_s=dp_s,
        tensor_parallel_comm_s=tp_s,
        pipeline_s=pp_s,
        step_s=step,
        tokens_per_step=batch.tokens_per_step,
        mfu=mfu,
        mfu_source=source,
    )


# ---- calibration from measured runs ----------------------------------------------------------


def calibration_from_records(records: list[dict]) -> dict[str, float]:
    """Measured MFU per device name, the median over runs; a record with "compiled" true (a
    train.compile run) counts under "<name>, compiled" instead (COMPILED).

    Each record has "device" (catalog name or "cpu") and "tokens_per_s" (measured), and either
    "estimated_tokens_per_s" (this estimator at the assumed MFU: the measured MFU is the assumed one
    scaled by measured / estimated) or "flops_per_token" and "peak_tflops" (optionally "world_size",
    default 1: MFU = tokens/s x FLOPs per token / (world x peak)).
    """
    by_device: dict[str, list[float]] = {}
    for rec in records:
        name, measured = rec.get("device"), rec.get("tokens_per_s")
        if not name or not measured or measured <= 0:
            continue
        if rec.get("estimated_tokens_per_s"):
            base = default_mfu(_device_for(name))
            value = base * measured / rec["estimated_tokens_per_s"]
        elif rec.get("flops_per_token") and rec.get("peak_tflops"):
            value = measured * rec["flops_per_token"] / (rec.get("world_size", 1) * rec["peak_tflops"] * 1e12)
        else:
            continue
        key = name + (COMPILED if rec.get("compiled") else "")
        by_device.setdefault(key, []).append(min(1.0, max(1e-4, value)))
    return {name: statistics.median(values) for name, values in by_device.items()}


def _device_for(name: str) -> DeviceSpec:
    if name == "cpu":
        return DeviceSpec(name="cpu", kind="cpu", capacity_bytes=0, bf16=True, peak_tflops=None)
    return CATALOG.get(name) or DeviceSpec(name=name, kind="cuda", capacity_bytes=0, bf16=True, peak_tflops=None)


def catalog_name(name: str) -> str | None:
    """'cpu', a catalog name, or the catalog card whose name is inside what CUDA reports
    ('NVIDIA H100 80GB HBM3' -> 'H100-80GB'), as device detection matches them; None if unknown."""
    if name == "cpu" or name in CATALOG:
        return name
    known = D.reported(name)
    return known.name if known else None


def records_from_registry(path: str | Path, devices: Iterable[str] | None = None) -> list[dict]:
    """Rows of the run registry's `runs` table (device, tokens_per_s, config_toml), each with the
    tokens/s this estimator predicts for its config at the assumed MFU. A missing file or table, or
    a row whose config no longer resolves (a model file gone), gives nothing for that row.
    `devices`: only rows measured on these (catalog names or "cpu"), the only ones a calibration
    for them reads; the others' configs are not parsed (a registry grows with every run)."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            rows = db.execute("SELECT device, tokens_per_s, config_toml FROM runs").fetchall()
    except sqlite3.Error:
        return []
    wanted = None if devices is None else set(devices)
    records, specs = [], {}
    for name, tokens_per_s, config_toml in rows:
        device = catalog_name(name or "")
        if device is None or not tokens_per_s or (wanted is not None and device not in wanted):
            continue
        try:
            cfg = C.from_dict(tomllib.loads(config_toml))
            world = len(parse_devices(cfg.hardware.gpus, cfg.hardware.gpu_mem))
            gpus = f"{world}x{device}" if world > 1 else device
            cfg = replace(cfg, hardware=replace(cfg.hardware, gpus=gpus, gpu_mem=None))
            if cfg.model.source not in specs:
                specs[cfg.model.source] = None  # a source that does not load is tried once
                specs[cfg.model.source] = load_model_spec(cfg.model.source)
            if specs[cfg.model.source] is None:
                continue
            r = resolve(cfg, specs[cfg.model.source])
            predicted = estimate(r).tokens_per_s
        except (TrainplanError, tomllib.TOMLDecodeError, TypeError, ValueError):
            continue
        if predicted:
            records.append(
                {
                    "device": device,
                    "tokens_per_s": tokens_per_s,
                    "estimated_tokens_per_s": predicted,
                    "compiled": torch_compile.active(r),
                }
            )
    return records
