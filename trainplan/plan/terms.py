"""The terms of one rank's analytic bill, assembled by trainplan/plan/analytic.py. Imports no torch.

Each component group is one function of the rank's frozen context (plan/context.py) returning bytes
and the line that explains them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from trainplan import features
from trainplan.features.pipeline_parallel import plan as pipeline_plan
from trainplan.plan import activations as A
from trainplan.plan.context import RankContext
from trainplan.plan.ledger import gib
from trainplan.plan.parts import Bytes
from trainplan.plan.tensors import (
    NF4_BYTES,
    NF4_CONSTANTS_BYTES,
    ZERO2_BUCKET_BYTES,
    _numel,
    _shard,
    _sharded_numel,
    optimizer_state_bytes,
    optimizer_temp_bytes,
)
from trainplan.spec.devices import MiB

# ---- component groups ------------------------------------------------------------------------


class Term(NamedTuple):
    nbytes: int
    note: str | None = None  # the ledger's explanation, when the term has one


def weights(ctx: RankContext) -> Term:
    """Parameters as stored: trainable ones in the param dtype, a frozen base in its storage dtype,
    QLoRA's linear layers in NF4 with their quantization constants."""
    prec, tp, shard_w, stage = ctx.prec, ctx.tp, ctx.shards.w, ctx.tensors
    w_train = stage.numel("held", tp, shard_w) * prec.param_bytes if ctx.full else 0
    w_quant = int(stage.numel("quantizable", tp, shard_w) * (NF4_BYTES + NF4_CONSTANTS_BYTES)) if ctx.quantized else 0
    not_quantized = "unquantized" if ctx.quantized else "held"
    w_frozen = 0 if ctx.full else stage.numel(not_quantized, tp, shard_w) * prec.frozen_bytes
    if ctx.full:
        note = (
            f"{ctx.n_held / 1e6:,.1f}M params x {prec.param_bytes} B "
            f"({ctx.dtype(prec.param_bytes)}{' master' if prec.autocast else ''})"
            + (f" / {shard_w} shards" if shard_w > 1 else "")
        )
    else:
        note = (
            f"{ctx.n_held / 1e6:,.1f}M frozen base params in {ctx.dtype(prec.frozen_bytes)}"
            + (f", linear layers in NF4 ({NF4_BYTES + NF4_CONSTANTS_BYTES:.3f} B/param)" if ctx.quantized else "")
            + " — frozen, but still in the bill"
        )
    return Term(w_train + w_frozen + w_quant, note)


def autocast_cast_numel(
    ctx: RankContext, subset: str = "cast", layer: int | None = None, *, plain_layers: bool = True
) -> int:
    """Elements of the trainable tensors autocast casts (tensors.py `_cast`: matmul weights only),
    per tensor-parallel rank: every one ("cast"), those outside the checkpointed layers plus
    `layer`'s ("cast_kept"), or `layer`'s alone ("cast_in_layer")."""
    if not ctx.full:
        return 0
    args: tuple = (ctx.r.fused_loss, ctx.last)
    if subset == "cast_kept":
        args += (ctx.ckpt.model_layers if plain_layers else ctx.spec.num_layers, layer)
    elif subset != "cast":
        args += (layer,)
    return ctx.tensors.numel((subset, *args), ctx.tp)


def casts_kept_by_checkpointing(ctx: RankContext, layer: int | None = None, *, plain_layers: bool = True) -> int:
    """Activation checkpointing with autocast: the cache is cleared when the forward (with the
    loss) leaves autocast, and a checkpointed layer saved no cast for backward, so only the casts
    of ops outside the checkpoints live into backward: the head's, and the layers' not checkpointed
    (`plain_layers`: until their backward has run), plus `layer`'s while it is recomputed."""
    return autocast_cast_numel(ctx, "cast_kept", layer, plain_layers=plain_layers) * ctx.cb


def weight_copies(ctx: RankContext) -> Term:
    """Weights held in a second dtype from forward until backward ends (the same in both)."""
    cb, dtype = ctx.cb, ctx.prec.compute_dtype
    if ctx.shards.fsdp:
        if ctx.dims.reshard_after_forward:
            # The root unit (embedding, final norm, head) stays gathered from the first layer to the
            # loss; each decoder layer is gathered for its own forward and backward.
            return Term(
                (ctx.shards.root_numel + ctx.shards.unit_numel) * cb,
                f"FSDP keeps the root unit ({ctx.shards.root_numel / 1e6:,.1f}M params) and one decoder layer "
                f"({ctx.shards.unit_numel / 1e6:,.1f}M) all-gathered in {dtype}",
            )
        return Term(
            ctx.n_held * cb,
            f"shard-grad-op keeps every unit unsharded from forward through backward: {ctx.n_held / 1e6:,.1f}M "
            f"params in {dtype}",
        )
    if ctx.autocast and ctx.full:
        return Term(
            autocast_cast_numel(ctx) * cb,
            f"autocast caches a {dtype} copy of every trainable matmul weight from forward until backward ends",
        )
    if ctx.quantized:
        big = ctx.tensors.largest("quantizable", ctx.tp)
        return Term(big * cb, f"the largest NF4 weight dequantized to {dtype} during its matmul")
    return Term(0)


class AdapterTerm(NamedTuple):
    """LoRA adapters (fp32): weights, gradients, optimizer states and autocast's copy, each a named term."""

    weights: Bytes
    grads: Bytes
    states: Bytes
    copy: Bytes  # autocast's cached copies in forward, every layer's (its cache lives until forward ends)
    note: str | None
    kept_copy: Bytes = Bytes()  # those the layers not checkpointed saved for backward
    layer_copy: Bytes = Bytes()  # one layer's, made again while a checkpointed layer is recomputed

    @property
    def live(self) -> int:
        """What the adapters hold outside backward's gradients, in forward."""
        return self.weights + self.states + self.copy

    @property
    def backward_live(self) -> int:
        """The same once backward starts: autocast's cache is gone, the saved copies stay."""
        return self.weights + self.states + self.kept_copy

    @property
    def recomputing(self) -> int:
        """What they hold while a checkpointed layer is recomputed and runs its backward: the layers
        above have run theirs (their copies released), the recomputed layer made its own again."""
        return self.weights + self.states + self.layer_copy


def lora_numel(ctx: RankContext, *, largest: bool = False) -> int:
    """The stage's adapter elements on this tensor-parallel rank, or its largest adapter tensor's (none when
    no adapters train: their targets are empty)."""
    return ctx.tensors.lora_numel(ctx.cfg.lora.r, ctx.adapters.targets, ctx.tp, largest=largest)


def adapter(ctx: RankContext) -> AdapterTerm:
    n_adapter = lora_numel(ctx)
    name, in_bwd = ctx.cfg.optim.name, in_backward(ctx)
    states = 0
    if ctx.adapters.on:
        states = _opt_bytes(
            ctx,
            ("states", name, 4, ctx.cpu, in_bwd),
            lambda: optimizer_state_bytes(name, list(ctx.shards.opt_shapes), 4, ctx.cpu, in_backward=in_bwd),
        )
        states //= ctx.shards.o
    note = None
    if ctx.adapters.on:
        note = (
            f"LoRA r={ctx.cfg.lora.r} on {', '.join(sorted(ctx.adapters.targets))}: {n_adapter / 1e6:,.2f}M "
            "fp32 params, with their gradients and optimizer states"
        )
    # autocast caches a cast of each adapter weight until forward leaves autocast; a checkpointed
    # layer saved none, so only the layers not checkpointed keep theirs into backward
    n_layers, ck = len(ctx.layers), ctx.ckpt.layers
    copied = n_adapter * ctx.cb if ctx.prec.autocast else 0
    one_layer = copied // n_layers if n_layers else 0
    return AdapterTerm(
        weights=Bytes(("the adapters' fp32 weights", -(-n_adapter // ctx.shards.w) * 4)),
        # step in backward: one adapter tensor's gradient at a time, the largest
        grads=Bytes(
            ("the largest adapter's gradient, one at a time", lora_numel(ctx, largest=True) * 4)
            if in_bwd
            else ("their gradients", -(-n_adapter // ctx.shards.g) * 4)
        ),
        states=Bytes(("their optimizer states", states)),
        copy=Bytes(("autocast's copy of them", copied)),
        note=note,
        kept_copy=Bytes(
            (
                f"autocast's copy of them{f' (the {n_layers - ck} layers not checkpointed)' if ck else ''}",
                copied - ck * one_layer,
            )
        ),
        layer_copy=Bytes(("autocast's copy of the recomputed layer's", one_layer)),
    )


def _pow2(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def pinned_fsdp_shards(ctx: RankContext) -> tuple[int, int]:
    """FSDP2's CPUOffloadPolicy on a GPU, in host bytes: (parameter shards, gradient shards). It pins
    each padded parameter shard, and each gradient shard's non-blocking copy to the host lands in
    page-locked memory too; CUDA's caching host allocator rounds every one up to a power of two."""
    tp, shards, prec = ctx.tp, ctx.shards.w, ctx.prec
    stored, grad_bytes = (prec.param_bytes, prec.grad_bytes) if ctx.full else (prec.frozen_bytes, 0)

    def pinned() -> tuple[int, int]:  # once a stage and layout: the advisor asks it of every candidate
        padded = [_sharded_numel(t, tp, shards) for t in ctx.tensors.held]
        adapters = sum(_pow2(_shard(s[0], math.prod(s[1:]), shards) * 4) for s in ctx.adapters.shapes)  # fp32, dim 0
        return sum(_pow2(n * stored) for n in padded) + adapters, sum(_pow2(n * grad_bytes) for n in padded) + adapters

    lora = (ctx.cfg.lora.r, ctx.adapters.targets) if ctx.adapters.on else None
    return ctx.tensors.memo(("pinned shards", tp, shards, stored, grad_bytes, lora), pinned)


class GradTerm(NamedTuple):
    nbytes: int  # every trainable gradient of the rank (sharded where the strategy shards them)
    live_fwd: int  # what of them persists into forward
    head: int  # the head's, formed first in backward
    first_layer: int  # the first layer's (and an untied embedding's), formed last
    note: str | None


def in_backward(ctx: RankContext) -> bool:
    """optim.step_in_backward: each parameter is updated by its own optimizer as soon as its gradient
    is formed, and the gradient freed (resolve() allows it on one device without accumulation)."""
    return features.step_in_backward.on(ctx.cfg)


def gradients(ctx: RankContext) -> GradTerm:
    tp, shard_g, grad_bytes = ctx.tp, ctx.shards.g, ctx.prec.grad_bytes
    if in_backward(ctx):
        # one gradient at a time, freed by its update: at most the largest tensor's
        largest = ctx.tensors.largest("held", tp) * grad_bytes if ctx.full else 0
        head = min(largest, ctx.head.numel * grad_bytes) if (ctx.head and ctx.last) else 0
        note = f"{grad_bytes} B per param of one tensor at a time, the largest: each is freed by its update in backward"
        return GradTerm(nbytes=largest, live_fwd=0, head=head, first_layer=0, note=note if ctx.full else None)
    grads = ctx.tensors.numel("held", tp, shard_g) * grad_bytes if ctx.full else 0
    head = (_sharded_numel(ctx.head, tp, shard_g) * grad_bytes) if (ctx.head and ctx.last) else 0
    first_layer = 0
    if ctx.full and ctx.layers:
        # the embedding's gradient comes last, unless it is tied to lm_head, whose comes first
        first_layer = ctx.tensors.numel("first_layer", tp, shard_g) * grad_bytes
    note = None
    if ctx.full:
        note = f"{grad_bytes} B per trainable param" + (f" / {shard_g} shards" if shard_g > 1 else "")
        if ctx.persistent_grads:
            why = (
                "DDP keeps gradients in its buckets between steps"
                if ctx.dims.keeps_grad_buckets
                else "ZeRO-2 keeps its gradient partition"
                if ctx.dims.keeps_grad_partition
                else "gradient accumulation keeps gradients across micro-batches"
            )
            note += f"; live in forward too: {why}"
    live_fwd = grads if (ctx.persistent_grads and ctx.full) else 0
    return GradTerm(nbytes=grads, live_fwd=live_fwd, head=head, first_layer=first_layer, note=note)


class OptTerm(NamedTuple):
    states: int
    temp: int  # temporaries inside optimizer.step()
    note: str | None
    temp_note: str


def optimizer(ctx: RankContext) -> OptTerm:
    """The base weights' optimizer states (full fine-tuning; the adapters' are in `adapter`) and
    the step's temporaries (the adapters' under LoRA)."""
    name, prec, shard_o, in_bwd = ctx.cfg.optim.name, ctx.prec, ctx.shards.o, in_backward(ctx)
    shapes = ctx.shards.opt_shapes
    states = 0
    if ctx.full:
        states = _opt_bytes(
            ctx,
            ("states", name, prec.state_bytes, ctx.cpu, in_bwd),
            lambda: optimizer_state_bytes(name, list(shapes), prec.state_bytes, ctx.cpu, in_backward=in_bwd),
        )
        states //= shard_o
    impl = ctx.cfg.optim.implementation
    if impl == "auto":
        impl = "for-loop" if ctx.cpu else "foreach"
    state_bytes = prec.state_bytes if ctx.full else 4

    def temp_bytes() -> int:
        if in_bwd:  # one optimizer per tensor, stepped inside backward: the largest single step's
            return max(
                (optimizer_temp_bytes(name, impl, [s], state_bytes, cpu=ctx.cpu) for s in set(shapes)), default=0
            )
        return optimizer_temp_bytes(name, impl, list(shapes), state_bytes, cpu=ctx.cpu)

    temp = _opt_bytes(ctx, ("temp", name, impl, state_bytes, ctx.cpu, in_bwd), temp_bytes)
    temp //= shard_o
    note = None
    if ctx.full:
        note = f"{name} states in {ctx.dtype(prec.state_bytes)}" + (f" / {shard_o} shards" if shard_o > 1 else "")
        if ctx.shards.zero1:
            mine = sum(_numel(t) for t in shapes)
            note += (
                f" of the {len(shapes)} tensors ({mine / 1e6:,.1f}M params) ZeroRedundancyOptimizer gives "
                f"rank {ctx.shards.dp_i}: largest first, to the least-loaded rank"
            )
    impl_text = ("CUDA kernel" if not ctx.cpu else "CPU backend") if features.optim8bit.is_8bit(name) else impl
    temp_note = f"{impl_text} {name} step temporaries" + (", of the largest tensor, inside backward" if in_bwd else "")
    return OptTerm(states=states, temp=temp, note=note, temp_note=temp_note)


def _opt_bytes(ctx: RankContext, key: tuple, compute) -> int:
    """compute() over the rank's optimizer shapes, once per shape set and `key` (what else it reads)."""
    return ctx.tensors.memo(("optimizer", ctx.shards.opt_key, *key), compute)


class CommTerm(NamedTuple):
    steady: Bytes  # forward and the start of backward
    end: Bytes  # once layers have run their backward
    note: str | None


def comm_buffers(ctx: RankContext, grads: int) -> CommTerm:
    """Pipeline receive buffers and the gradient reduction's buffers. `grads`: the rank's gradients."""
    recv, recv_note = pipeline_plan.receive_buffers(ctx)
    steady = Bytes(("pipeline receive buffers, one per micro-batch of the step", recv))
    end, note = steady, None
    if ctx.dims.reshard_after_forward:
        # the unsharded gradient of a layer before its reduce-scatter: only once layers run backward
        unit_grads = ctx.shards.unit_numel * ctx.prec.grad_bytes if ctx.full else 0
        end += Bytes(("one FSDP unit's unsharded gradient before its reduce-scatter", unit_grads))
        if unit_grads:
            note = "the unsharded gradient of one FSDP unit before its reduce-scatter"
    elif ctx.dims.keeps_grad_partition and ctx.full:  # ZeRO-2 reduces into its partition a bucket at a time
        end += Bytes(("one 25 MiB gradient bucket being reduced", min(ZERO2_BUCKET_BYTES, grads * ctx.shards.g)))
        note = "one 25 MiB gradient bucket being reduced"
    if steady and not note:
        note = recv_note
    return CommTerm(steady=steady, end=end, note=note)


BUFFERS_NOTE = "registered module buffers: the rotary embedding's inv_freq and its original, in fp32"


def buffers(ctx: RankContext) -> int:
    return 0 if ctx.spec.model_type == "gpt2" else 2 * (ctx.spec.head_dim // 2) * 4  # rotary inv_freq (+ original)


def runtime(ctx: RankContext) -> int:
    """What the device holds outside every tensor: the runtime and workspaces, and what FSDP2's
    optimizer offload was measured to hold (offload_untracked)."""
    hw = ctx.cfg.hardware
    base = (hw.cpu_runtime_mib if ctx.cpu else hw.cuda_context_mib + hw.cublas_workspace_mib) * MiB
    return base + offload_untracked(ctx)


# FSDP2's CPUOffloadPolicy on CUDA: the one measured row (docs/gpu-validation.md, row 25 of the
# 2026-12-04 H200 run: Llama-3.2-3B full, one GPU, torch 2.11) held 14.90e9 B of allocated device
# memory that no tensor the dispatch mode sees owns, from the first step on: 1.154x the model's fp32
# parameters beyond the other rows' median untracked workspace (70.3e6 B). Not explained yet (the next
# lent GPU dumps the allocator's snapshot for it); planned, rounded up, on the rank's stored parameter
# shard until it is.
OFFLOAD_UNTRACKED = 1.16
OFFLOAD_UNTRACKED_NOTE = (
    "FSDP2's optimizer offload held {factor:.2f}x the stored parameters on the device outside every tensor on the "
    "one measured GPU row (docs/gpu-validation.md row 25, not yet explained): planned as {size} on this rank's shard"
)


def offload_untracked(ctx: RankContext) -> int:
    """The device bytes FSDP2's CPUOffloadPolicy was measured to hold outside every tensor (0 elsewhere)."""
    if ctx.cpu or features.optimizer_offload.how(ctx.r, cpu=ctx.cpu) != "fsdp2":
        return 0
    stored = ctx.prec.param_bytes if ctx.full else ctx.prec.frozen_bytes
    shard = sum(_sharded_numel(t, ctx.tp, ctx.shards.w) for t in ctx.tensors.held) * stored
    return math.ceil(OFFLOAD_UNTRACKED * shard)


def _layer_saved(ctx: RankContext, *, input_requires_grad: bool = True) -> tuple[A.SavedTensor, ...]:
    """One layer's saved tensors (activations.py)."""
    return ctx.saved[input_requires_grad][0]


def _layer_saved_bytes(ctx: RankContext, *, input_requires_grad: bool = True) -> int:
    return ctx.saved[input_requires_grad][1]


def layer_saved_details(ctx: RankContext) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of each tensor one layer saves, for the ledger's details."""
    return ctx.saved[True][2]


class ActTerm(NamedTuple):
    fwd: int  # saved for backward, at the end of forward
    bwd: int  # at the start of backward
    first_layer_bwd: int  # the first layer's backward, at the end of backward
    per_layer: tuple[A.SavedTensor, ...]  # one layer's saved tensors
    saved_layers: int  # every layer's of one micro-batch
    head_saved: list[A.SavedTensor]
    layer_in: int  # one layer's input (the residual stream)
    kept: int  # what a checkpointed layer keeps: its input, and under selective checkpointing its matmul outputs
    step_inputs: int
    note: str
    inputs: Bytes = Bytes()  # every micro-batch in flight's step inputs, named
    end_inputs: Bytes = Bytes()  # the same at the first layer's backward (one eager mask left)
    recompute_inputs: Bytes = Bytes()  # at the top checkpointed layer's
    # memory.offload_activations: what the hooks pass to the host per step (the layers not checkpointed;
    # on the CPU they stay, the host being the device), and what that holds in host memory
    offloaded: int = 0
    host: int = 0
    # what an offloaded layer holds on the device while it runs (forward) or its backward runs: its
    # saved tensors, in no moment outside it (the logits, the final norm's backward)
    layer_on_device: int = 0
    kept_on_device: int = 0  # of `kept`, what stays on the device (its input goes to the host when offloaded)


def activations(ctx: RankContext) -> ActTerm:
    spec, act, batch, in_flight = ctx.spec, ctx.act, ctx.batch, ctx.in_flight
    n_layers = len(ctx.layers)
    per_layer, per_layer_bytes = _layer_saved(ctx), _layer_saved_bytes(ctx)
    ck = ctx.ckpt.layers  # the stage's first ck layers keep only their input (checkpointing)
    layer_in = ctx.tokens * spec.hidden_size * ctx.residual
    kept = layer_in + (ctx.saved["selective"] if ctx.ckpt.selective else 0)  # per checkpointed layer
    saved_layers = ck * kept + (n_layers - ck) * per_layer_bytes
    first_plain = ctx.first and not ctx.full and ck == 0
    if first_plain:
        # the frozen embedding's output needs no grad: layer 0's first norm saves nothing
        saved_layers += _layer_saved_bytes(ctx, input_requires_grad=False) - per_layer_bytes
    offloaded = host = layer_on_device = 0
    if ctx.offload_acts:
        # the plain layers' saved tensors, and the checkpointed layers' inputs (ALST's checkpoints in host memory;
        # selective checkpointing's kept outputs stay with the checkpoint, on the device)
        offloaded = in_flight * (saved_layers - ck * (kept - layer_in))
        if not ctx.cpu:  # the device keeps one layer's saved tensors while it forms or is back for backward
            saved_layers, layer_on_device = ck * (kept - layer_in), per_layer_bytes if n_layers > ck else layer_in
            host = offloaded
            if ctx.offload_acts == "pinned":
                n_plain = n_layers - ck - (1 if first_plain else 0)
                host = n_plain * sum(_pow2(t.nbytes) for t in per_layer)  # pinned: rounded to powers of two
                if first_plain:
                    host += sum(_pow2(t.nbytes) for t in _layer_saved(ctx, input_requires_grad=False))
                host = in_flight * (host + ck * _pow2(layer_in))
    head_saved = A.head_saved(spec, act, lm_head_trainable=ctx.full and not ctx.fused) if ctx.last else []
    micro = f", x {in_flight} micro-batches in flight" if in_flight > 1 else ""
    layers_saved = Bytes((f"the layers' saved tensors{micro}", in_flight * saved_layers))
    head_part = Bytes((f"the final norm's and the head's saved tensors{micro}", in_flight * A.total(head_saved)))
    top = ctx.saved["largest"]
    plain = (
        f"{gib(per_layer_bytes)} saved per layer (micro-batch {batch.micro_batch_size}, seq {batch.seq_len}) x "
        f"{in_flight} micro-batch(es) in flight"
        + (f"; largest saved tensor {top.name} {gib(top.nbytes)}" if top else "")
    )
    what = f"input and matmul and attention outputs ({gib(kept)})" if ctx.ckpt.selective else f"input ({gib(layer_in)})"
    if ck == n_layers and ck:
        note = (
            f"{'selective ' if ctx.ckpt.selective else ''}checkpointing keeps each layer's {what} x {n_layers} "
            f"layers x {in_flight} micro-batch(es) in flight, plus one layer recomputed in "
            f"backward ({gib(per_layer_bytes)})"
        )
    elif ck:
        note = (
            f"{'selective ' if ctx.ckpt.selective else ''}checkpointing the first {ck} of {n_layers} layers keeps "
            f"each one's {what} (one "
            f"recomputed at a time in backward); the other {n_layers - ck} layers x {plain}"
        )
    else:
        note = f"{n_layers} layers x {plain}"
    if offloaded:
        parts = [
            f"{n_layers - ck} layer(s) not checkpointed" if n_layers > ck else "",
            f"{ck} checkpointed layers' inputs" if ck else "",
        ]
        moved = " and ".join(p for p in parts if p)
        moved += f" ({gib(offloaded)})"
        note += (
            f"; offloaded: the saved tensors of {moved} pass through the offload hooks and stay, the host being "
            "the device"
            if ctx.cpu
            else f"; offloaded: the saved tensors of {moved} are in host memory, one layer's on the device at a time"
        )
    step_inputs = A.step_inputs_bytes(spec, act)
    mask = A.kept_mask_bytes(act, ck, ctx.residual)
    step = (f"the step's ids, labels and rotary tables{micro}", in_flight * step_inputs)
    kind = "eager attention's"

    def with_masks(n: int) -> Bytes:
        return Bytes(step, (f"{kind} {n} 4-D mask(s), kept by the checkpoints{micro}", in_flight * n * mask))

    inputs = with_masks(A.attention_masks(spec))
    bwd = layers_saved + head_part + inputs  # recomputation starts after the loss's backward; see backward_moments
    # lm_head saved a cast, or nothing: the final hidden state is still referenced by the model
    # output during the loss
    hidden = (
        ctx.tokens * spec.hidden_size * ctx.residual if ctx.last and (ctx.autocast or not ctx.full or ctx.fused) else 0
    )
    fwd = bwd + Bytes(("the final hidden state, still referenced by the model output", hidden))
    return ActTerm(
        fwd=fwd,
        bwd=bwd,
        first_layer_bwd=_first_layer_backward(ctx, layer_in),
        end_inputs=with_masks(1),
        recompute_inputs=with_masks(min(A.attention_masks(spec), ck)),
        per_layer=per_layer,
        saved_layers=saved_layers,
        head_saved=head_saved,
        layer_in=layer_in,
        kept=kept,
        kept_on_device=kept - layer_in if ctx.offload_acts and not ctx.cpu else kept,
        step_inputs=step_inputs,
        note=note,
        inputs=inputs,
        offloaded=offloaded,
        host=host,
        layer_on_device=layer_on_device,
    )


def moe_backward(ctx: RankContext) -> tuple[int, int, int]:
    """One sparse MoE block's backward at its widest moment: (its saved tensors already released,
    the temporaries held, the expert gradient formed before it). Three moments compete (counted on
    the trace): the routing-weight multiply's backward, the act(gate) * up product's (the
    gradients of the product, of act(gate) and of up: three rows x intermediate tensors), and the
    gate_up grouped matmul's (the gradient of its output and of the gathered input, beside the
    gate_up weight's gradient being formed)."""
    spec, xb, gb = ctx.spec, ctx.act.expert_bytes, ctx.prec.grad_bytes
    rows, h, n = (spec.mlp.experts_per_token or 1) * ctx.tokens, spec.hidden_size, spec.mlp.num_experts
    inter = spec.intermediate_size // ctx.tp
    trains = ctx.full
    # the routing-weight multiply: the fp32 gradient scattered back, and its two fp32 products (the
    # routing weights' before it is summed over hidden), beside the down output's cast gradient
    routing = (rows * 8, 3 * rows * h * 4 + rows * h * xb, 0)
    # the routing-weight multiply, the scatter back and the down projection have run their backward
    released = rows * h * xb + rows * 4 + rows * 8 + n * 4 + (rows * inter * xb if trains else 0)
    formed = n * h * inter * gb if trains else 0  # the down projection's weight gradient
    product = (released, 3 * rows * inter * xb, formed)
    released += rows * inter * xb + rows * 2 * inter * xb  # then the product and the activation
    gate_up = (released, rows * 2 * inter * xb + rows * h * xb + (n * 2 * inter * h * gb if trains else 0), formed)
    return max(routing, product, gate_up, key=lambda m: m[1] + m[2] - m[0])


POST_MLP_NORM = "post_feedforward_layernorm."


def _first_layer_backward(ctx: RankContext, layer_in: int) -> int:
    # Backward through the first layer: its saved tensors (recomputed under checkpointing) plus the
    # gradients of the MLP's intermediates (d product, d act, d up, d gate), in the compute dtype.
    tokens, inter, cb = ctx.tokens, ctx.inter, ctx.cb
    input_requires_grad = ctx.full or bool(ctx.ckpt.layers)
    saved = _layer_saved_bytes(ctx, input_requires_grad=input_requires_grad)
    # a norm after the MLP (Gemma-2's post_feedforward_layernorm) runs its backward first: its saved
    # tensors are gone by the MLP's, and its own backward is a moment of its own
    post = [t for t in _layer_saved(ctx, input_requires_grad=input_requires_grad) if t.name.startswith(POST_MLP_NORM)]
    post_saved = sum(t.nbytes for t in post)
    if ctx.spec.mlp.num_experts:  # the MoE block's widest moment
        released, temps, formed = moe_backward(ctx)
        mlp_bwd = temps + formed - released
    else:  # d product, d act and d up (d product is freed before silu's backward forms d gate)
        mlp_bwd = 3 * ctx.mlp_tokens * inter * cb + ctx.mlp_tile_backward
    first_layer_bwd = saved - post_saved + mlp_bwd + layer_in  # + the residual stream's gradient
    if post:  # the post-MLP norm's backward: its input still saved, five fp32 (tokens x hidden) temporaries
        post_input = sum(t.nbytes for t in post if ".input" in t.name)
        norm_bwd = saved - (post_saved - post_input) + 5 * tokens * ctx.spec.hidden_size * 4 + layer_in
        first_layer_bwd = max(first_layer_bwd, norm_bwd)
    if ctx.ckpt.layers and ctx.residual != 4:  # else the norm's fp32 input is the kept input
        first_layer_bwd += layer_in
    return first_layer_bwd


class LossTerm(NamedTuple):
    by_phase: dict[str, int]  # forward, backward, backward_grads
    note: str | None


def logits_loss(ctx: RankContext, grads: GradTerm) -> LossTerm:
    spec, prec, tokens, chunk = ctx.spec, ctx.prec, ctx.tokens, ctx.cfg.train.loss_chunk_tokens
    head_grad = grads.head if (ctx.full and not ctx.persistent_grads) else 0
    if ctx.fused:
        head_bytes = ctx.cb if ctx.shards.fsdp else (prec.param_bytes if ctx.full else prec.frozen_bytes)
        logits = A.fused_loss_bytes(spec, ctx.act, chunk_tokens=chunk, head_trainable=ctx.full, head_bytes=head_bytes)
        note = (
            f"fused loss: {min(chunk, tokens)} of {tokens} tokens' logits "
            f"at a time over {spec.vocab_size:,} vocab, plus the hidden-state gradient"
            + (" and the head weight's gradient" if ctx.full else "")
        )
    elif ctx.last:
        logits = A.logits_loss_bytes(spec, ctx.act, head_grad)
        note = (
            f"{tokens} tokens x {spec.vocab_size:,} vocab: logits in {prec.compute_dtype}, the fp32 upcast "
            "for the loss, log-softmax output and its gradients"
        ) + (f" (the head's logits gathered whole from {ctx.tp} tp ranks' vocabulary shards)" if ctx.tp > 1 else "")
    else:
        logits, note = {"forward": 0, "backward": 0, "backward_grads": 0}, None
    return LossTerm(logits, note)


class RankTerms(NamedTuple):
    """One training rank's terms, as the features' `adjust` read them (features/<name>/plan.py)."""

    weights: Term
    copies: Term
    adapter: AdapterTerm
    grads: GradTerm
    opt: OptTerm
    acts: ActTerm
    loss: LossTerm
    comm: CommTerm
