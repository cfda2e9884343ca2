"""The one validated job: `Resolved` drives plan, trace, advise, train and accept alike.

`resolve()` refuses what cannot be planned; `require_runnable()` refuses what can be planned but
not run by the training engine (trainplan/run/), and is the one place that says so: `train`
calls it before building anything, and `advise` asks it of every candidate it ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainplan import config as C
from trainplan.errors import ConfigError
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
    def compiles(self) -> bool:
        """train.compile resolved: "auto" compiles a training run on GPUs."""
        setting = self.cfg.train.compile
        if setting == "auto":  # not beside activation offload, whose hooks need the eager layers' saved tensors
            return self.training and all(d.is_gpu for d in self.devices) and not self.cfg.memory.offload_activations
        return setting

    @property
    def budget_bytes(self) -> int | None:
        """hardware.memory_budget in bytes: a cap on every device's bill."""
        budget = self.cfg.hardware.memory_budget
        return None if budget is None else parse_size(budget, "hardware.memory_budget")

    @property
    def fused_loss(self) -> bool:
        train = self.cfg.train
        return fused_loss_applies(self.spec, enabled=train.fused_loss, mode=self.cfg.mode, tp=self.dims.tp)


def with_lora_modules(cfg: C.RunConfig, spec: ModelSpec) -> C.RunConfig:
    """cfg with its LoRA target sets ("attention", "all-linear") expanded to spec's module names."""
    modules = list(spec.lora_modules(cfg.lora.target_modules))
    if modules == cfg.lora.target_modules:  # already module names (the advisor's rungs)
        return cfg
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=modules))


def resolve(cfg: C.RunConfig, spec: ModelSpec | None = None) -> Resolved:
    """Validate cfg against the model and the devices: the job every command plans or runs."""
    spec = spec or load_model_spec(cfg.model.source)
    devices = parse_devices(cfg.hardware.gpus, cfg.hardware.gpu_mem)
    prec = PRECISIONS[cfg.precision]
    no_bf16 = [d.name for d in devices if not d.bf16]
    if prec.needs_bf16 and no_bf16:
        raise ConfigError(
            "run.precision",
            f"{cfg.precision} needs bf16, which {no_bf16[0]} lacks",
            'use precision = "amp-fp16" (fp16 autocast with loss scaling)',
        )
    if cfg.mode == "qlora" and any(not d.is_gpu for d in devices):
        raise ConfigError(
            "run.mode",
            "qlora needs CUDA GPUs (bitsandbytes 4-bit kernels)",
            'plan for GPUs (hardware.gpus) or use mode = "lora" on the CPU',
        )
    if cfg.parallel.offload_optimizer and cfg.mode == "inference":
        raise ConfigError(
            "parallel.offload_optimizer",
            "inference has no optimizer (or gradients) to offload",
            "set parallel.offload_optimizer = false",
        )
    if cfg.parallel.offload_optimizer and any(not d.is_gpu for d in devices) and not _fsdp(cfg):
        raise ConfigError(
            "parallel.offload_optimizer",
            f"on the CPU only FSDP2's offload runs, and parallel.strategy is {cfg.parallel.strategy} (there it moves "
            "nothing: the host is the device)",
            'set parallel.strategy = "zero3" or "fsdp-grad-op", or parallel.offload_optimizer = false',
        )
    if cfg.memory.offload_activations and cfg.mode == "inference":
        raise ConfigError(
            "memory.offload_activations",
            "inference saves no activations for a backward",
            "set memory.offload_activations = false",
        )
    if cfg.memory.offload_activations and cfg.memory.activation_checkpointing is True:
        raise ConfigError(
            "memory.offload_activations",
            "every layer is checkpointed (memory.activation_checkpointing = true): no layer is left to offload",
            'checkpoint fewer layers (a number, or "auto") or set memory.offload_activations = false',
        )
    if cfg.train.compile is True and cfg.memory.offload_activations:
        raise ConfigError(
            "train.compile",
            "a compiled layer saves other tensors than the eager one, without the autograd history that tells "
            "memory.offload_activations a weight's copy from an activation",
            'set train.compile = false (or "auto"), or memory.offload_activations = false',
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
    if cfg.mode in ("lora", "qlora"):
        known = {lin.module for lin in spec.layer_linears}
        cfg = with_lora_modules(cfg, spec)
        for target in cfg.lora.target_modules:
            if target not in known:
                raise ConfigError(
                    "lora.target_modules",
                    f"{target!r} matches no linear layer of {spec.name}",
                    "its linear layers are " + ", ".join(sorted(known)),
                )
    ac = cfg.memory.activation_checkpointing
    if not isinstance(ac, bool) and isinstance(ac, int) and ac > spec.num_layers:
        raise ConfigError(
            "memory.activation_checkpointing",
            f"{ac} layers, but {spec.name} has {spec.num_layers}",
            f"use at most {spec.num_layers}, or true to checkpoint every layer",
        )
    if cfg.memory.checkpointing_policy == "selective" and (spec.num_experts or spec.derived):
        kind = "a mixture of experts" if spec.num_experts else "planned from derived terms"
        raise ConfigError(
            "memory.checkpointing_policy",
            f"selective checkpointing is planned for dense layers with hand-written terms; {spec.name} is {kind}",
            'use "full"',
        )
    if cfg.memory.checkpointing_policy == "selective" and spec.attention(cfg.memory.attention) == "eager":
        raise ConfigError(
            "memory.checkpointing_policy",
            "selective checkpointing is planned with SDPA attention, and this run uses eager attention",
            'set memory.attention = "sdpa" where the model has it, or use "full"',
        )
    if cfg.hardware.memory_budget is not None:
        parse_size(cfg.hardware.memory_budget, "hardware.memory_budget")  # refuses a size without a unit
    spec.attention(cfg.memory.attention)  # refuses sdpa where transformers has none
    dims = build_parallel_dims(cfg.parallel, len(devices), spec)
    batch = resolve_batch(cfg.batch, dims.dp)
    if cfg.optim.step_in_backward and cfg.mode != "inference":
        _require_step_in_backward(cfg, dims, batch, prec)
    return Resolved(cfg=cfg, spec=spec, precision=prec, devices=devices, dims=dims, batch=batch)


def _require_step_in_backward(cfg: C.RunConfig, dims: ParallelDims, batch: ResolvedBatch, prec: Precision) -> None:
    """optim.step_in_backward updates each parameter inside backward, as soon as its gradient is
    formed: whatever needs every gradient of the step before the first update cannot run with it."""
    refusals = (
        (
            batch.grad_accum_steps > 1,
            "batch.grad_accum_steps",
            f"is {batch.grad_accum_steps}, but optim.step_in_backward updates the weights in every backward, "
            "so gradients cannot accumulate over micro-batches",
            "set batch.global_batch_size = batch.micro_batch_size x data-parallel degree (accumulation 1), "
            "or optim.step_in_backward = false",
        ),
        (
            cfg.train.max_grad_norm > 0,
            "train.max_grad_norm",
            f"is {cfg.train.max_grad_norm:g}: clipping by the global norm needs every gradient before the first "
            "update, but optim.step_in_backward updates each parameter as its gradient is formed",
            "set train.max_grad_norm = 0 (no clipping), or optim.step_in_backward = false",
        ),
        (
            dims.world_size > 1,
            "optim.step_in_backward",
            f"runs in one process only, not on {dims.world_size} devices: the hook fires on the local gradient, "
            "before DDP's all-reduce (or FSDP's reduce-scatter) has averaged it across ranks",
            "plan one device, or set optim.step_in_backward = false",
        ),
        (
            prec.loss_scaling,
            "run.precision",
            f"{cfg.precision} scales the loss, and the GradScaler must see every gradient for inf before any "
            "update, which optim.step_in_backward applies in backward",
            'use precision = "amp-bf16" or "fp32", or optim.step_in_backward = false',
        ),
        (
            cfg.guard.enabled,
            "guard.enabled",
            "the stability guard decides whether to apply a step after its gradients are complete, but "
            "optim.step_in_backward has applied each update by then",
            "set guard.enabled = false, or optim.step_in_backward = false",
        ),
        (
            cfg.parallel.offload_optimizer,
            "parallel.offload_optimizer",
            "offloaded states are stepped on the host after backward, not inside it",
            "set parallel.offload_optimizer = false, or optim.step_in_backward = false",
        ),
    )
    for refused, field, problem, fix in refusals:
        if refused:
            raise ConfigError(field, problem, fix)


def _fsdp(cfg: C.RunConfig) -> bool:
    """The strategy is one of FSDP2's (parameters sharded)."""
    return cfg.parallel.strategy in ("zero3", "fsdp-grad-op")


class NotRunnable(ConfigError):
    """A configuration the planner covers but the training engine does not run; `what` names the
    missing capability in a few words (advise shows it beside the entry)."""

    def __init__(self, field: str, problem: str, fix: str, *, what: str):
        self.what = what
        super().__init__(field, problem, fix)


def require_runnable(cfg: C.RunConfig, dims: ParallelDims, *, max_positions: int | None = None, cuda: bool) -> None:
    """Refuse what `trainplan train` cannot run. The engine runs data parallelism (DDP, ZeRO-1,
    FSDP2) with torch's optimizers, and QLoRA on CUDA through bitsandbytes without sharding.

    dims: the layout as it will run (at data-parallel degree 1 every strategy is "single");
    max_positions: the model's context (a longer sequence is refused); cuda: whether the run has
    CUDA devices."""
    if dims.tp > 1 or dims.pp > 1:
        raise NotRunnable(
            "parallel.tp",
            "the training engine runs data parallelism (DDP, ZeRO-1, FSDP2) only",
            "set parallel.tp = 1 and parallel.pp = 1 for `trainplan train`",
            what="tensor/pipeline parallelism",
        )
    if dims.keeps_grad_partition:
        raise NotRunnable(
            "parallel.strategy",
            "zero2 (DeepSpeed's replicated parameters, sharded gradients) is planned but not run by this engine",
            "use parallel.strategy = fsdp-grad-op (FSDP2 without resharding, ZeRO-2-like) or zero3",
            what="ZeRO-2",
        )
    if cfg.optim.name == "adamw-8bit" and cfg.mode != "inference":
        _require_bitsandbytes_optimizer(dims)
    if cfg.parallel.offload_optimizer and cfg.mode != "inference" and not dims.shards_params:
        raise NotRunnable(
            "parallel.offload_optimizer",
            "the engine offloads through FSDP2's CPUOffloadPolicy (parameter shards, their gradients and the "
            f"optimizer on the host), on one device or many; {cfg.parallel.strategy} with offload is planned as "
            "DeepSpeed's ZeRO-Offload but not run",
            'set parallel.strategy = "zero3", or parallel.offload_optimizer = false',
            what="optimizer offload without FSDP2",
        )
    if cfg.mode == "qlora" and not cuda:
        raise NotRunnable(
            "run.mode",
            "qlora needs bitsandbytes on CUDA; it cannot be built on the CPU (the analytic plan covers it)",
            'run it on CUDA GPUs, or use mode = "lora" here',
            what="QLoRA without CUDA",
        )
    if cfg.mode == "qlora" and dims.shards_params:
        raise NotRunnable(
            "run.mode",
            f"qlora with parallel.strategy = {dims.strategy} (sharded 4-bit weights) is not run by this engine",
            "use parallel.strategy = ddp",
            what="sharded QLoRA",
        )
    if max_positions is not None and cfg.batch.seq_len > max_positions and not cfg.model.extend_context:
        raise NotRunnable(
            "batch.seq_len",
            f"{cfg.batch.seq_len} exceeds the model's context of {max_positions}",
            f"use batch.seq_len <= {max_positions}",
            what=f"a sequence beyond the model's {max_positions} positions",
        )


def _require_bitsandbytes_optimizer(dims: ParallelDims) -> None:
    """adamw-8bit runs bitsandbytes' AdamW8bit (its CUDA kernels, or its CPU backend) on plain
    tensors, in one process or under DDP."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise NotRunnable(
            "optim.name",
            "adamw-8bit runs bitsandbytes' AdamW8bit, and bitsandbytes is not installed",
            "pip install -r requirements.txt (it pins bitsandbytes), or use optim.name = adamw",
            what="8-bit AdamW without bitsandbytes",
        )
    if dims.strategy not in ("single", "ddp"):
        raise NotRunnable(
            "parallel.strategy",
            f"adamw-8bit with {dims.strategy} is not run by this engine: bitsandbytes' kernels take whole plain "
            "tensors, not FSDP2's DTensor shards or ZeroRedundancyOptimizer's partitions",
            "use parallel.strategy = ddp, or optim.name = adamw",
            what="sharded 8-bit AdamW",
        )
