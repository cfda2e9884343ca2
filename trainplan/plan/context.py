"""One rank's context: everything the terms of its bill share, computed once per rank by
`rank_context` (the tensors the rank holds, dtypes, how its state is sharded, what its layers save),
as torchtitan splits its per-rank setup from the parts built on it. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from trainplan import config as C
from trainplan import features
from trainplan.plan import activations as A
from trainplan.plan.tensors import StageTensors, _tp_numel, stage_tensors, zero1_partition
from trainplan.resolve import Resolved
from trainplan.run import sources
from trainplan.spec.devices import DeviceSpec
from trainplan.spec.model import ModelSpec, ParamTensor
from trainplan.spec.parallel import ParallelDims, ResolvedBatch
from trainplan.spec.precision import Precision


@dataclass(frozen=True, kw_only=True)
class Shards:
    """How the rank's weights, gradients and optimizer states are split (spec/parallel.py's strategy)."""

    fsdp: bool  # the strategy shards parameters (FSDP2)
    zero1: bool  # the engine's ZeroRedundancyOptimizer partition
    dp_i: int  # the rank's data-parallel index (its ZeRO-1 partition)
    w: int  # how many ways weights, gradients and optimizer states are split evenly
    g: int
    o: int
    root_numel: int  # FSDP: the root unit (embedding, final norm, head) per tensor-parallel rank
    unit_numel: int  # FSDP: the largest decoder-layer unit
    opt_shapes: tuple[tuple[int, ...], ...]  # trainable shapes whose optimizer states this rank holds
    opt_key: tuple  # what opt_shapes depends on: the key of sums over them in the stage's tensors


@dataclass(frozen=True, kw_only=True)
class Adapters:
    """LoRA's (or QLoRA's) adapters on the stage."""

    on: bool
    targets: frozenset[str]
    shapes: tuple[tuple[int, ...], ...]  # the stage's adapter tensors, tensor-parallel shards


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Activation checkpointing: the first `model_layers` decoder layers of the model recompute."""

    model_layers: int
    layers: int  # of them, the ones on this stage (its first `layers` layers)
    selective: bool  # memory.checkpointing_policy = "selective"


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What every term of one rank's bill depends on, computed once by `rank_context`."""

    r: Resolved
    rank: int
    device: DeviceSpec
    stage: int  # pipeline stage
    first: bool  # the stage holds the embedding
    last: bool  # the stage holds the head and computes the loss
    layers: range  # decoder layers of the stage
    tensors: StageTensors  # the stage's tensors and memoized sums over them
    n_held: int  # the elements of its parameter tensors on this tensor-parallel rank
    quantized: tuple[ParamTensor, ...]  # QLoRA's NF4 linear and expert weights
    head: ParamTensor | None  # the trainable lm_head (or the embedding tied to it): its gradient comes first
    full: bool  # full fine-tuning
    adapters: Adapters
    shards: Shards
    cpu: bool
    cb: int  # compute dtype bytes
    autocast: bool
    residual: int  # residual stream bytes
    persistent_grads: bool  # gradients live from one micro-batch's backward into the next forward
    fused: bool  # the fused (chunked) loss runs on this stage
    in_flight: int  # micro-batches whose activations a pipeline stage holds at once
    ckpt: Checkpointing
    act: A.ActContext
    saved: dict  # `_saved`: one layer's saved tensors, its input requiring grad or not; "selective": kept bytes
    offload_acts: str  # memory.offload_activations while training: "" (off), "pageable" or "pinned"

    @property
    def spec(self) -> ModelSpec:
        return self.r.spec

    @property
    def cfg(self) -> C.RunConfig:
        return self.r.cfg

    @property
    def prec(self) -> Precision:
        return self.r.precision

    @property
    def dims(self) -> ParallelDims:
        return self.r.dims

    @property
    def batch(self) -> ResolvedBatch:
        return self.r.batch

    @property
    def tp(self) -> int:
        return self.r.dims.tp

    @property
    def tokens(self) -> int:
        return self.act.tokens

    @property
    def mlp_tokens(self) -> int:
        """The tokens the MLP's working set spans in a training step: all, or one tile's under memory.tiled_mlp."""
        return self.mlp_tokens_at(self.act.batch, self.act.seq)

    def mlp_tokens_at(self, rows: int, seq: int) -> int:
        """The same for `rows` rows of `seq` tokens (evaluation's own)."""
        if not self.act.mlp_in_tiles:
            return rows * seq
        return rows * -(-seq // features.tiled_mlp.tiles(seq, self.spec.hidden_size))

    @property
    def mlp_tile_backward(self) -> int:
        """Under memory.tiled_mlp, what an MLP's backward adds to its intermediate gradients: one tile's
        recompute (the MLP's saved tensors for its tokens), the input's gradient, allocated whole, and under a
        full fine-tune the MLP's weight gradients twice (summed over the tiles, and one tile's)."""
        if not self.act.mlp_in_tiles:
            return 0
        n = features.tiled_mlp.tiles(self.act.seq, self.spec.hidden_size)
        tile = A.tiled_mlp_recompute(self.spec, self.act, -(-self.act.seq // n))
        weights = sum(lin.in_features * lin.out_features for lin in self.spec.layer_linears if lin.group == "mlp")
        grads = 2 * weights // self.tp * self.prec.grad_bytes if self.full else 0
        return tile + self.tokens * self.spec.hidden_size * self.residual + grads

    @property
    def inter(self) -> int:
        """MLP intermediate width on this tensor-parallel rank, times the experts a token visits."""
        return self.spec.intermediate_size // self.tp * (self.spec.mlp.experts_per_token or 1)

    def dtype(self, nbytes: int) -> str:
        return {4: "fp32", 2: self.prec.compute_dtype}[nbytes]


def _fsdp_units(stage: StageTensors, tp: int) -> tuple[int, int]:
    """FSDP units' elements per tensor-parallel rank: the root unit (embedding, final norm, head)
    and the largest decoder layer."""
    per_layer_numel: dict[int, int] = {}  # one pass over the tensors, not one per layer
    for t in stage.held:
        if t.layer is not None:
            per_layer_numel[t.layer] = per_layer_numel.get(t.layer, 0) + _tp_numel(t, tp)
    unit = max((per_layer_numel.get(i, 0) for i in stage.layers), default=0)
    return stage.numel("root", tp), unit


def _shards(r: Resolved, tensors: StageTensors, dp_i: int, adapters: Adapters, *, full: bool) -> Shards:
    dims, tp, dp = r.dims, r.dims.tp, r.dims.dp
    fsdp = dims.shards_params
    zero1 = dims.partitions_optimizer_by_tensor and dp > 1
    mine = tensors.shapes(tp) if full else adapters.shapes
    opt_key = ("full", tp) if full else ("lora", r.cfg.lora.r, adapters.targets, tp)
    if zero1:
        opt_key += (dp, dp_i)
        opt_shapes = tensors.memo(("zero1", opt_key), lambda: tuple(zero1_partition(list(mine), dp)[dp_i]))
    else:
        opt_shapes = mine
    root, unit = tensors.memo(("fsdp_units", tp), lambda: _fsdp_units(tensors, tp)) if fsdp else (0, 0)
    return Shards(
        fsdp=fsdp,
        zero1=zero1,
        dp_i=dp_i,
        w=dp if fsdp else 1,
        g=dp if dims.shards_grads else 1,
        # ZeRO-1 gives whole tensors to ranks (opt_shapes) rather than splitting each one
        o=dp if dims.shards_optimizer and not zero1 else 1,
        root_numel=root,
        unit_numel=unit,
        opt_shapes=opt_shapes,
        opt_key=opt_key,
    )


def rank_context(r: Resolved, rank: int, like: RankContext | None = None) -> RankContext:
    """Everything one rank's terms share, computed once. `like`: this rank's context of the same job
    at another micro-batch (the advisor's search): only what the micro-batch changes is recomputed."""
    if like is not None:
        return _at_micro_batch(like, r)
    spec, cfg, prec, dims = r.spec, r.cfg, r.precision, r.dims
    device = r.devices[rank]
    stage, dp_i, _ = dims.coords(rank)
    first, last = stage == 0, stage == dims.pp - 1
    tensors = stage_tensors(spec, dims, stage)
    layers, tp = tensors.layers, dims.tp
    full = cfg.mode == "full"
    lora = features.lora.on(cfg)
    targets = frozenset(cfg.lora.target_modules) if lora else frozenset()
    adapters = Adapters(on=lora, targets=targets, shapes=tensors.lora_shapes(cfg.lora.r, targets, tp) if lora else ())
    shards = _shards(r, tensors, dp_i, adapters, full=full)
    cpu = device.kind == "cpu"
    cb = prec.compute_bytes
    # FSDP's MixedPrecisionPolicy replaces autocast: params are all-gathered in the compute
    # dtype, so the residual stream is 16-bit too. Under plain autocast the residual stream is
    # fp32 when the embedding's stored weight is (full fine-tuning); a frozen base is stored in
    # the compute dtype, so LoRA's residual stream is 16-bit.
    autocast = prec.autocast and not shards.fsdp
    residual = 4 if (autocast and full) else cb
    heads = tensors.select("lm_head") or (tensors.select("embedding") if spec.tie_word_embeddings else ())
    act = _act_context(r, full=full, fsdp=shards.fsdp, autocast=autocast, residual=residual, targets=targets, cpu=cpu)
    return RankContext(
        r=r,
        rank=rank,
        device=device,
        stage=stage,
        first=first,
        last=last,
        layers=layers,
        tensors=tensors,
        n_held=tensors.numel("held", tp),
        quantized=tensors.select("quantizable") if features.qlora.on(cfg) else (),
        head=heads[0] if full and heads else None,
        full=full,
        adapters=adapters,
        shards=shards,
        cpu=cpu,
        cb=cb,
        autocast=autocast,
        residual=residual,
        fused=r.fused_loss and last,
        **_batch_fields(r, stage),
        ckpt=Checkpointing(
            model_layers=r.checkpointed_layers,
            layers=max(0, min(layers.stop, r.checkpointed_layers) - layers.start),
            selective=features.checkpointing.selective(cfg),
        ),
        act=act,
        saved=_saved(r, act),
        offload_acts=features.activation_offload.kind(cfg),
    )


def _batch_fields(r: Resolved, stage: int) -> dict:
    """The fields of RankContext that depend on the micro-batch through the accumulation steps."""
    dims, accum = r.dims, r.batch.grad_accum_steps
    return {
        "persistent_grads": dims.keeps_grads_between_steps or accum > 1,
        "in_flight": min(dims.pp - stage, accum) if dims.pp > 1 else 1,
    }


def _at_micro_batch(like: RankContext, r: Resolved) -> RankContext:
    if (like.r.dims is not r.dims and like.r.dims != r.dims) or like.act.seq != features.context_parallel.local_seq(r):
        raise AssertionError("rank_context(like=...) takes a context of the same job at another micro-batch")
    # frozen dataclasses: copy the fields, then set the batch's (dataclasses.replace would validate
    # every field again, a third of the advisor's time per plan)
    act = object.__new__(A.ActContext)
    act.__dict__.update(like.act.__dict__, batch=r.batch.micro_batch_size)
    ctx = object.__new__(RankContext)
    ctx.__dict__.update(like.__dict__, r=r, act=act, saved=_saved(r, act), **_batch_fields(r, like.stage))
    return ctx


def _act_context(
    r: Resolved, *, full: bool, fsdp: bool, autocast: bool, residual: int, targets: frozenset[str], cpu: bool
) -> A.ActContext:
    """What plan/activations.py needs to list the tensors a layer saves for backward."""
    spec, cfg, batch, cb = r.spec, r.cfg, r.batch, r.precision.compute_bytes
    return A.ActContext(
        batch=batch.micro_batch_size,
        seq=features.context_parallel.local_seq(r),
        compute_bytes=cb,
        residual_bytes=residual,
        autocast=autocast,
        trainable_linears=frozenset(lin.module for lin in spec.layer_linears) if full else frozenset(),
        norms_trainable=full,
        lora_targets=targets,
        lora_r=cfg.lora.r,
        lora_dropout=cfg.lora.dropout,
        adapter_bytes=cb if fsdp else 4,  # FSDP2 gathers the adapters in its param dtype too
        # MoE experts run transformers' grouped matmul, which autocast does not cover: it casts its
        # input to the experts' own dtype (FSDP2: the dtype it gathers them in)
        expert_bytes=cb if fsdp else (r.precision.param_bytes if full else r.precision.frozen_bytes),
        attention=r.attention,
        cpu=cpu,
        dropout_active=r.training,
        tp=r.dims.tp,
        cp=r.dims.cp if r.training else 1,
        mlp_in_tiles=features.tiled_mlp.active(r),
        packed=r.training and sources.packing(r.cfg.data)[0] == "document",
    )


def _saved(r: Resolved, act: A.ActContext) -> dict[bool, tuple]:
    """One layer's saved tensors, their bytes and (name, bytes) pairs, with its input requiring a
    gradient (True) or not (False), what selective checkpointing keeps ("selective") and the largest
    saved tensor ("largest"): once per model and activation context. Under train.compile a layer
    saves what inductor's partitioner chose (features/torch_compile/plan.py)."""
    spec = r.spec
    # tensor and pipeline parallelism keep the eager terms (the capture runs one whole layer): an upper
    # bound for a compiled step, which saves less (docs/memory-model.md)
    compiled = features.torch_compile.active(r) and r.training and r.dims.tp == 1 and r.dims.pp == 1
    key = ("layer_saved", act, compiled)
    if key not in spec.memo:
        out = {}
        for input_requires_grad in (True, False):
            if compiled:
                saved = (_compiled_layer(r, act, input_requires_grad),)
            else:
                saved = tuple(A.layer_saved(spec, act, input_requires_grad=input_requires_grad))
            out[input_requires_grad] = saved, A.total(saved), tuple((s.name, s.nbytes) for s in saved)
        out["selective"] = None if spec.layer_fit is not None else A.total(A.selective_kept(spec, act))
        # for the note (a compiled layer's figure is one sum, no tensor of its own)
        out["largest"] = None if compiled else max(out[True][0], key=lambda s: s.nbytes, default=None)
        spec.memo[key] = out
    return spec.memo[key]


def _compiled_layer(r: Resolved, act: A.ActContext, input_requires_grad: bool) -> A.SavedTensor:
    from trainplan.features.torch_compile import plan as compiled

    fits = compiled.fits(r)
    fit = fits.rest if input_requires_grad else fits.first
    return A.SavedTensor(
        name="decoder layer, compiled (what inductor's partitioner saves, measured on fake tensors)",
        nbytes=fit.nbytes(act.batch, act.seq),
    )
