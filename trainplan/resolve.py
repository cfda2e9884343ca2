"""The one validated job: `Resolved` drives plan, trace, advise, train and accept alike.

`resolve()` refuses what cannot be planned; `require_runnable()` refuses what can be planned but
not run by the training engine (trainplan/run/), and is the one place that says so: `train`
calls it before building anything, and `advise` asks it of every candidate it ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainplan import config as C
from trainplan import features
from trainplan.errors import ConfigError, NotRunnable
from trainplan.spec.devices import DeviceSpec, parse_devices, parse_size
from trainplan.spec.model import ModelSpec, fused_loss_applies, load_model_spec
from trainplan.spec.parallel import ParallelDims, ResolvedBatch, build_parallel_dims, resolve_batch
from trainplan.spec.precision import PRECISIONS, Precision


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """Everything the plan needs, validated: the same object later drives `train`."""

    cfg: C.RunConfig
    spec: ModelSpec
    precision: Precision
    devices: list[DeviceSpec]
    dims: ParallelDims
    batch: ResolvedBatch

    @property
    def attention(self) -> str:
        return self.spec.attention(self.cfg.memory.attention)

    @property
    def training(self) -> bool:
        return self.cfg.mode != "inference"

    @property
    def checkpointed_layers(self) -> int:
        """How many decoder layers recompute in backward (the first ones): memory.activation_checkpointing
        as a count. "auto" is chosen by the planner (plan/analytic.py `choose_checkpointing`) before
        anything plans or builds with it."""
        ac = self.cfg.memory.activation_checkpointing
        if not self.training or ac is False:
            return 0
        if ac is True:
            return self.spec.num_layers
        if ac == "auto":
            raise AssertionError('memory.activation_checkpointing = "auto" reached the planner unchosen')
        return ac

    @property
    def budget_bytes(self) -> int | None:
        """hardware.memory_budget in bytes: a cap on every device's bill."""
        budget = self.cfg.hardware.memory_budget
        return None if budget is None else parse_size(budget, "hardware.memory_budget")

    @property
    def fused_loss(self) -> bool:
        train = self.cfg.train
        return fused_loss_applies(self.spec, enabled=train.fused_loss, mode=self.cfg.mode, tp=self.dims.tp)


def auto_precision(devices: list[DeviceSpec]) -> str:
    """precision = "auto": mixed precision, bf16 where every GPU has it, fp16 with loss scaling where
    one does not; fp32 where any device is the CPU, whose 16-bit matmuls are no faster and, without
    AVX512-BF16 or AMX, emulated (48-128x slower than fp32 on an AVX2 core, bench/cpu_bf16.py). The
    same answer on every machine: a plan for `--gpus cpu` does not depend on the CPU's flags."""
    if any(not d.is_gpu for d in devices):
        return "fp32"
    return "amp-bf16" if all(d.bf16 for d in devices) else "amp-fp16"


def resolve(cfg: C.RunConfig, spec: ModelSpec | None = None) -> Resolved:
    """Validate cfg against the model and the devices: the job every command plans or runs."""
    spec = spec or load_model_spec(cfg.model.source)
    devices = parse_devices(cfg.hardware.gpus, cfg.hardware.gpu_mem)
    if cfg.precision == "auto":
        cfg = dataclasses.replace(cfg, precision=auto_precision(devices))
    prec = PRECISIONS[cfg.precision]
    no_bf16 = [d.name for d in devices if not d.bf16]
    if prec.needs_bf16 and no_bf16:
        raise ConfigError(
            "run.precision",
            f"{cfg.precision} needs bf16, which {no_bf16[0]} lacks",
            'use precision = "amp-fp16" (fp16 autocast with loss scaling)',
        )
    if spec.learned_positions and cfg.batch.seq_len > spec.learned_positions:
        raise ConfigError(
            "batch.seq_len",
            f"{cfg.batch.seq_len} exceeds the {spec.learned_positions} learned positions of {spec.name}",
            f"use batch.seq_len <= {spec.learned_positions}",
        )
    context = spec.max_position_embeddings
    if not spec.learned_positions and cfg.batch.seq_len > context and not cfg.model.extend_context:
        raise ConfigError(
            "batch.seq_len",
            f"{cfg.batch.seq_len} exceeds the model's context of {context} ({spec.name})",
            f"use batch.seq_len <= {context}, or set model.extend_context = true for RoPE-scaled use",
        )
    if spec.derived:  # LoRA's targets resolve against the real module's linear layers; SDPA is as it declares
        from trainplan.spec import layout

        spec = layout.with_layout(spec, cfg.model.cache_dir)
    if features.lora.on(cfg):
        cfg = features.lora.with_modules(cfg, spec)
    for name in ("memory_budget", "host_mem"):  # refused now, whether or not this plan reads them
        if getattr(cfg.hardware, name):
            parse_size(getattr(cfg.hardware, name), f"hardware.{name}")
    spec.attention(cfg.memory.attention)  # refuses sdpa where transformers has none
    dims = build_parallel_dims(cfg.parallel, len(devices), spec)
    batch = resolve_batch(cfg.batch, dims.data_dp)
    r = Resolved(cfg=cfg, spec=spec, precision=prec, devices=devices, dims=dims, batch=batch)
    features.refuse(r)
    return r


def model_facts(spec) -> dict:
    """What require_runnable reads of a model (its keyword arguments), from its spec."""
    return {
        "max_positions": spec.max_position_embeddings,
        "model_type": spec.model_type,
        "tied": spec.tie_word_embeddings,
        "grouped_kv": spec.num_kv_heads < spec.num_heads,
    }


def require_runnable(
    cfg: C.RunConfig,
    dims: ParallelDims,
    *,
    max_positions: int | None = None,
    cuda: bool,
    model_type: str | None = None,
    tied: bool = False,
    grouped_kv: bool = False,
) -> None:
    """Refuse what `trainplan train` cannot run: each feature's own rule (trainplan/features/), and a
    sequence beyond the model's context. The engine runs data parallelism (DDP, ZeRO-1, FSDP2) with
    torch's optimizers, and QLoRA on CUDA through bitsandbytes without sharding.

    dims: the layout as it will run (at data-parallel degree 1 every strategy is "single");
    max_positions: the model's context (a longer sequence is refused); cuda: whether the run has
    CUDA devices; model_type: the architecture (tensor and pipeline parallelism split some), where
    known; tied: the model ties its head to its embedding (the pipeline's stages cannot share it); grouped_kv:
    it has fewer key/value heads than query heads (Phi-3's fused qkv_proj cannot then be split)."""
    features.require_runnable(cfg, dims, cuda=cuda)
    if model_type is not None and dims.tp > 1:
        features.tensor_parallel.runnable_model(model_type, dims, grouped_kv=grouped_kv)
    if model_type is not None and dims.pp > 1:
        features.pipeline_parallel.runnable_model(model_type, tied=tied)
    if max_positions is not None and cfg.batch.seq_len > max_positions and not cfg.model.extend_context:
        raise NotRunnable(
            "batch.seq_len",
            f"{cfg.batch.seq_len} exceeds the model's context of {max_positions}",
            f"use batch.seq_len <= {max_positions}",
            what=f"a sequence beyond the model's {max_positions} positions",
        )
