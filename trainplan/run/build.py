"""Build the model the way it will run: meta -> mode -> precision -> checkpointing -> parallelize
-> materialize. The same builder serves the fake-tensor trace and the real run, so the plan
traces the code that actually runs.
"""

from __future__ import annotations

import torch
from torch import nn

from trainplan import features
from trainplan.config import RunConfig
from trainplan.errors import TrainplanError
from trainplan.features.activation_offload import engine as activation_offload
from trainplan.features.checkpointing import engine as checkpointing
from trainplan.features.context_parallel import engine as context_parallel
from trainplan.features.lora import engine as lora
from trainplan.features.pipeline_parallel import engine as pipeline_parallel
from trainplan.features.qlora import engine as qlora
from trainplan.features.sharding import engine as sharding
from trainplan.features.tensor_parallel import engine as tensor_parallel
from trainplan.features.tiled_mlp import engine as tiled_mlp
from trainplan.run import attention, loss, sources
from trainplan.run.converter import Build, dtypes
from trainplan.spec.layout import causal_lm_type
from trainplan.spec.model import ModelSpec, fused_loss_applies
from trainplan.spec.parallel import ParallelDims
from trainplan.spec.precision import Precision


def hf_config(spec: ModelSpec, cfg: RunConfig):
    """The transformers config for the spec, with trainplan's attention and cache settings."""
    import transformers

    if not spec.config:
        raise TrainplanError(f"model.source: {spec.name} carries no transformers config to build from")
    causal_lm_type(spec.config["model_type"])
    hf = transformers.CONFIG_MAPPING[spec.config["model_type"]](**spec.config)
    hf._attn_implementation = attention_implementation(spec, cfg)
    hf.use_cache = cfg.mode == "inference"
    return hf


def attention_implementation(spec: ModelSpec, cfg: RunConfig) -> str:
    """What transformers' attention layers run: the requested kernel (spec.attention), except that training on
    packed documents runs SDPA one document at a time with no mask (run/attention.py), as do the ranks of a
    context-parallel job, whose attention takes the whole sequence from its peers."""
    impl = spec.attention(cfg.memory.attention)
    documents = sources.packing(cfg.data)[0] == "document"
    if impl == "sdpa" and cfg.mode != "inference" and (documents or features.context_parallel.on(cfg)):
        attention.register()
        return attention.IMPLEMENTATION
    return impl


def _attention(model: nn.Module, b: Build) -> nn.Module:
    if attention.uses(model.config):
        attention.install(model)
    return model


def buffers_to(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move the module buffers (rotary frequencies) to `device`, the parameters staying where they are."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != torch.device(device):
                module._buffers[name] = buf.to(device)
    return model


def _fused_loss(model: nn.Module, b: Build) -> nn.Module:
    tp = b.dims.tp if b.dims is not None else 1
    if fused_loss_applies(b.spec, enabled=b.cfg.train.fused_loss, mode=b.cfg.mode, tp=tp):
        loss.install(model, b.cfg.train.loss_chunk_tokens)
    return model


def _train_mode(model: nn.Module, b: Build) -> nn.Module:
    return model.train() if b.cfg.mode != "inference" else model


# The features as the engine applies them to the meta model, in this fixed order (torchtitan's model
# converters): each feature's `engine.apply` (trainplan/features/<name>/engine.py) returns the model,
# unchanged where its feature is off. torch.compile comes last, after the weights are loaded
# (run/setup.py, features/torch_compile/engine.py), so the layers it compiles are final.
CONVERTERS = (
    ("4-bit base", qlora.apply),
    ("mode (lora adapters, what trains)", lora.apply),
    ("fused loss", _fused_loss),
    ("tiled MLP", tiled_mlp.apply),
    ("checkpointing", checkpointing.apply),
    ("activation offload", activation_offload.apply),
    ("train mode", _train_mode),
    ("attention (packed documents without a mask)", _attention),
    ("context parallel (the sequence split)", context_parallel.apply),
    ("pipeline stage (the pp cut)", pipeline_parallel.apply),
    ("tensor parallel (the tp split)", tensor_parallel.apply),
    ("sharding (FSDP2, optimizer offload)", sharding.apply),
)


def build_model(
    spec: ModelSpec,
    cfg: RunConfig,
    prec: Precision,
    *,
    dims: ParallelDims | None = None,
    mesh=None,
    stage: int = 0,
    allow_cpu: bool = False,
) -> nn.Module:
    """The model on the meta device, with every converter of CONVERTERS applied in order (stage: this
    rank's pipeline stage, where dims has pp > 1).

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
    build = Build(spec=spec, cfg=cfg, prec=prec, dims=dims, mesh=mesh, stage=stage)
    for _, convert in CONVERTERS:
        model = convert(model, build)
    return model


def allocate(model: nn.Module, device: torch.device | str) -> nn.Module:
    """to_empty, then re-tie. to_empty gives each module its own copy of a shared parameter, so a
    tied output head is taken out first: the vocabulary-sized matrix is allocated once, not twice."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tied = getattr(base.config, "tie_word_embeddings", False)
    head = base.get_output_embeddings() if tied else None
    # (not under FSDP2, which registered the shared parameter with its units when it sharded them;
    # tensor parallelism's shared DTensor is a parameter like any other)
    from torch.distributed.fsdp import FSDPModule

    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    shared = head is not None and not fsdp and head.weight is base.get_input_embeddings().weight
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


def adapter_generator(seed: int, name: str) -> torch.Generator:
    """An adapter matrix's own generator, from the run's seed and the matrix's name: its values do not
    depend on which other adapters the rank holds (a pipeline stage holds its own layers' only)."""
    import zlib

    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _init_adapter(p: nn.Parameter, generator: torch.Generator, *, zero: bool) -> None:
    """PEFT's init of one adapter matrix (A Kaiming-uniform, B zero), the same whatever the layout: the
    whole matrix is drawn on the host from its own generator (`adapter_generator`: the run's seed and its
    name, so neither the base's init, the device nor the other adapters change it) and a sharded
    parameter (FSDP2, tp) keeps its own box. A tp, FSDP2 or pipeline run starts from the adapters one
    process starts from."""
    from trainplan import _torch_private as P

    if zero or P.is_fake(p):  # the trace's fake tensors: any values
        nn.init.zeros_(p) if zero else nn.init.kaiming_uniform_(p, a=5**0.5)
        return
    whole = torch.empty(p.shape, dtype=p.dtype)
    nn.init.kaiming_uniform_(whole, a=5**0.5, generator=generator)
    if hasattr(p, "device_mesh"):
        box = P.local_slice(p)
        p.to_local().copy_(whole[box] if box is not None else whole)
    else:
        p.copy_(whole)


def materialize(
    model: nn.Module, device: torch.device | str, *, quantize: bool = True, loading: bool = False
) -> nn.Module:
    """Allocate the meta model on `device` and initialize it (weights, rotary buffers).

    qlora: the 4-bit linears are quantized last; quantize=False leaves them unquantized on the
    host, for a loader to copy weights into before it calls `qlora.quantize`.
    loading: the base weights are copied in next, so transformers' initializers skip them (the flag
    its own from_pretrained sets): only buffers and adapters are initialized. Besides the time, an
    initializer can gather a sharded weight whole (an embedding's padding row zeroed through a
    vocabulary-split DTensor: two whole V x hidden copies on every tp rank at load)."""
    allocate(model, device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if loading:
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p._is_hf_initialized = True
    with torch.no_grad():
        base.init_weights()
        seed = torch.initial_seed()
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT's own init: A random, B zero
                _init_adapter(p, adapter_generator(seed, name), zero="lora_B" in name)
    if quantize and qlora.is_4bit(model):
        qlora.quantize(model, device)
    return model
