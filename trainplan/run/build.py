"""Build the model the way it will run: meta -> mode -> precision -> checkpointing -> parallelize
-> materialize. The same builder serves the fake-tensor trace and the real run, so the plan
traces the code that actually runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainplan import features
from trainplan.config import RunConfig
from trainplan.errors import ConfigError, TrainplanError
from trainplan.run import loss, offload, qlora
from trainplan.spec.model import ModelSpec, fused_loss_applies
from trainplan.spec.parallel import ParallelDims
from trainplan.spec.precision import Precision


@dataclass(frozen=True)
class Dtypes:
    param: torch.dtype  # trainable parameters as stored
    frozen: torch.dtype  # frozen parameters as stored
    compute: torch.dtype


def dtypes(prec: Precision) -> Dtypes:
    half = torch.float16 if prec.loss_scaling else torch.bfloat16
    by_bytes = {4: torch.float32, 2: half}
    return Dtypes(
        param=by_bytes[prec.param_bytes], frozen=by_bytes[prec.frozen_bytes], compute=by_bytes[prec.compute_bytes]
    )


def hf_config(spec: ModelSpec, cfg: RunConfig):
    """The transformers config for the spec, with trainplan's attention and cache settings."""
    import transformers

    if not spec.config:
        raise TrainplanError(f"model.source: {spec.name} carries no transformers config to build from")
    hf = transformers.CONFIG_MAPPING[spec.config["model_type"]](**spec.config)
    hf._attn_implementation = spec.attention(cfg.memory.attention)
    hf.use_cache = cfg.mode == "inference"
    return hf


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (FSDP units, checkpointing units), found through PEFT wrappers too."""
    for module in model.modules():
        for name in ("layers", "h"):
            blocks = getattr(module, name, None)
            if isinstance(blocks, nn.ModuleList) and len(blocks) and module is not model:
                return list(blocks)
    raise TrainplanError("model.source: cannot find the decoder layers of this model")


def apply_mode(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """full: everything trains. lora/qlora: PEFT adapters, base frozen. inference: nothing trains."""
    if cfg.mode == "full":
        model.requires_grad_(True)
        return model
    model.requires_grad_(False)
    if cfg.mode == "inference":
        return model.eval()
    import peft

    lora = peft.LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    # PEFT upcasts the adapters to fp32 when the base is 16-bit (autocast_adapter_dtype=True).
    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return peft.get_peft_model(model, lora)


def apply_fsdp(model: nn.Module, dims: ParallelDims, prec: Precision, mesh) -> nn.Module:
    """FSDP2: one unit per decoder layer plus the root; mixed precision through the policy.
    parallel.offload_optimizer: CPUOffloadPolicy keeps the parameter shards, their gradients and the
    optimizer step in host memory (pinned for CUDA's copies); `materialize_params_on_host` says where
    the parameters are allocated."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dt = dtypes(prec)
    mp = MixedPrecisionPolicy(
        param_dtype=dt.compute, reduce_dtype=torch.float32 if prec.grad_bytes == 4 else dt.compute
    )
    on_host = features.optimizer_offload.on_host(dims)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if on_host else OffloadPolicy()
    reshard = dims.reshard_after_forward
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    return model


def buffers_to(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move the module buffers (rotary frequencies) to `device`, the parameters staying where they are."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != torch.device(device):
                module._buffers[name] = buf.to(device)
    return model


@dataclass(frozen=True)
class Build:
    """What a converter reads: the job's model, settings and layout (dims None: one process, no mesh)."""

    spec: ModelSpec
    cfg: RunConfig
    prec: Precision
    dims: ParallelDims | None
    mesh: Any


def _quantized_base(model: nn.Module, b: Build) -> nn.Module:
    """QLoRA: the base's linear layers become bitsandbytes' 4-bit ones (quantized when materialized)."""
    if features.qlora.on(b.cfg):
        dt = dtypes(b.prec)
        qlora.swap_linears(model, b.spec, compute_dtype=dt.compute, frozen_dtype=dt.frozen)
    return model


def _mode(model: nn.Module, b: Build) -> nn.Module:
    return apply_mode(model, features.lora.with_modules(b.cfg, b.spec))  # target sets expanded, however cfg came


def _fused_loss(model: nn.Module, b: Build) -> nn.Module:
    tp = b.dims.tp if b.dims is not None else 1
    if fused_loss_applies(b.spec, enabled=b.cfg.train.fused_loss, mode=b.cfg.mode, tp=tp):
        loss.install(model, b.cfg.train.loss_chunk_tokens)
    return model


def _checkpointing(model: nn.Module, b: Build) -> nn.Module:
    ac = b.cfg.memory.activation_checkpointing
    if ac is not False and b.cfg.mode != "inference":
        checkpoint_layers(model, b.spec, ac, features.checkpointing.policy(b.cfg))
    return model


def _activation_offload(model: nn.Module, b: Build) -> nn.Module:
    """The layers not checkpointed pass their saved tensors to the host."""
    moved = features.activation_offload.kind(b.cfg)
    if moved:
        ac = b.cfg.memory.activation_checkpointing
        offload.install(model, decoder_layers(model)[b.spec.num_layers if ac is True else int(ac) :], moved)
    return model


def _train_mode(model: nn.Module, b: Build) -> nn.Module:
    return model.train() if b.cfg.mode != "inference" else model


def _sharding(model: nn.Module, b: Build) -> nn.Module:
    """FSDP2 (with optimizer offload's CPUOffloadPolicy where it is on); DDP and ZeRO-1 wrap later (dist.wrap)."""
    if b.dims is not None and b.dims.shards_params:
        return apply_fsdp(model, b.dims, b.prec, b.mesh)
    return model


# The features as the engine applies them to the meta model, in this fixed order (torchtitan's model
# converters): each returns the model, unchanged where its feature is off. torch.compile comes last,
# after the weights are loaded (run/setup.py `compile_layers`), so the layers it compiles are final.
CONVERTERS = (
    ("4-bit base", _quantized_base),
    ("mode (lora adapters, what trains)", _mode),
    ("fused loss", _fused_loss),
    ("checkpointing", _checkpointing),
    ("activation offload", _activation_offload),
    ("train mode", _train_mode),
    ("sharding (FSDP2, optimizer offload)", _sharding),
)


def build_model(
    spec: ModelSpec,
    cfg: RunConfig,
    prec: Precision,
    *,
    dims: ParallelDims | None = None,
    mesh=None,
    allow_cpu: bool = False,
) -> nn.Module:
    """The model on the meta device, with every converter of CONVERTERS applied in order.

    Materialize it with `materialize` (real tensors) or inside a fake mode (the tracer).
    allow_cpu: build qlora without CUDA, on bitsandbytes' CPU backend (tests only).
    """
    import transformers

    if features.qlora.on(cfg):  # the one rule train and advise apply too, asked again of the builder
        cuda = torch.cuda.is_available() or allow_cpu
        one = ParallelDims(world_size=1, dp=1, tp=1, pp=1, strategy="single")
        features.qlora.runnable(cfg, dims or one, cuda=cuda)
    dt = dtypes(prec)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(spec, cfg), dtype=dt.param if cfg.mode == "full" else dt.frozen
        )
    build = Build(spec=spec, cfg=cfg, prec=prec, dims=dims, mesh=mesh)
    for _, convert in CONVERTERS:
        model = convert(model, build)
    return model


# Selective checkpointing keeps these ops' outputs and recomputes the rest (norms, activations,
# RoPE, residual adds): the matmuls and attention hold most of a layer's compute, the element-wise
# ops most of its saved bytes. torch's selective activation checkpoint (torch.utils.checkpoint).
SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def _selective_context():
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, name).default for name in SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def checkpoint_layers(model: nn.Module, spec, setting: bool | int | str, policy: str = "full") -> None:
    """Activation checkpointing on the first N decoder layers (True: every one). The first ones
    hold their activations longest (backward reaches them last), so they are the ones to recompute.
    transformers' switch turns it on for every layer; the layers from N on are turned back off.
    policy "selective": the checkpointed layers keep their matmul and attention outputs (SAVED_OPS)."""
    if setting == "auto":
        raise ConfigError(
            "memory.activation_checkpointing",
            '"auto" is chosen by the planner before a run, and this run was started without it',
            "start it with `trainplan train` (which chooses), or give a number of layers",
        )
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}
    if policy == features.checkpointing.SELECTIVE:
        kwargs["context_fn"] = _selective_context()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(layers) != spec.num_layers:
        raise AssertionError(f"found {len(layers)} decoder layers to checkpoint, the spec has {spec.num_layers}")
    if setting is not True:
        for layer in layers[setting:]:
            layer.gradient_checkpointing = False


def compile_layers(model: nn.Module, *, backend: Any = "inductor", dynamic: bool | None = None) -> int:
    """train.compile: torch.compile on each decoder layer's forward (regional compilation, as torchtitan
    and torchtune do): every layer runs the same code, so one compiled graph serves them all and compile
    time stays bounded by one layer's; the layers' hooks (FSDP2's, offload's) and checkpointing's wrapper
    stay outside the compiled region. Returns the number of layers compiled. (`backend`, `dynamic`: the
    planner's compile of fake layers, plan/compiled.py.)"""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=dynamic)
    return len(layers)


def allocate(model: nn.Module, device: torch.device | str) -> nn.Module:
    """to_empty, then re-tie. to_empty gives each module its own copy of a shared parameter, so a
    tied output head is taken out first: the vocabulary-sized matrix is allocated once, not twice."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tied = getattr(base.config, "tie_word_embeddings", False)
    head = base.get_output_embeddings() if tied else None
    # (not under FSDP2, which registered the shared parameter with its units when it sharded them)
    sharded = any(hasattr(p, "device_mesh") for p in model.parameters())
    shared = head is not None and not sharded and head.weight is base.get_input_embeddings().weight
    if shared:
        del head.weight
    if qlora.is_4bit(model):
        qlora.allocate(model, device)
    else:
        model.to_empty(device=device)
    if tied:
        if shared:
            head.weight = base.get_input_embeddings().weight
        base.tie_weights()
    return model


def materialize(model: nn.Module, device: torch.device | str, *, quantize: bool = True) -> nn.Module:
    """Allocate the meta model on `device` and initialize it (weights, rotary buffers).

    qlora: the 4-bit linears are quantized last; quantize=False leaves them unquantized on the
    host, for a loader to copy weights into before it calls `qlora.quantize`."""
    allocate(model, device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        base.init_weights()
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT's own init: A random, B zero
                nn.init.zeros_(p) if "lora_B" in name else nn.init.kaiming_uniform_(p, a=5**0.5)
    if quantize and qlora.is_4bit(model):
        qlora.quantize(model, device)
    return model
