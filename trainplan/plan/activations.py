"""Activation memory: the tensors autograd saves for backward, enumerated one by one.

Each entry names the tensor in the transformers implementation that saves it, so the ledger
can say *why* activations cost what they cost. The literature formula (Korthikanti et al.
2022) is kept beside it as a hand-checkable reference; tests pin both.

Conventions: T = micro-batch x sequence tokens on this rank, h hidden size, I MLP width,
cb compute bytes (2 under bf16/fp16), rb bytes of the residual stream (fp32 under autocast:
the embedding output is fp32 and every residual add promotes to fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainplan.plan.parts import Bytes
from trainplan.plan.tensors import ROWWISE
from trainplan.spec.model import ModelSpec

INT64 = 8
BOOL = 1  # CUDA's fused dropout saves a torch.bool mask
FP32 = 4


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    name: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class ActContext:
    batch: int  # micro-batch size per rank
    seq: int
    compute_bytes: int
    residual_bytes: int
    autocast: bool
    trainable_linears: frozenset[str]  # base linear modules whose weight requires grad
    norms_trainable: bool
    lora_targets: frozenset[str] = frozenset()
    lora_r: int = 0
    lora_dropout: float = 0.0
    adapter_bytes: int = FP32
    expert_bytes: int = FP32  # MoE expert weights as the grouped matmul sees them
    attention: str = "sdpa"
    dropout_active: bool = True  # training mode: nn.Dropout with p > 0 saves a mask
    # On CUDA, dropout is the fused native_dropout, which saves a bool mask. The CPU path computes
    # input * noise and saves the noise in the input's dtype.
    cpu: bool = False
    tp: int = 1
    # context parallelism: seq is a rank's 1/cp of each sequence; attention takes the whole sequence for 1/cp
    # of the heads (the same bytes, but KV heads fewer than cp repeated to cp) and returns its output to the
    # rank's slice through an all-to-all, a new tensor as packed documents' assembled output is
    cp: int = 1
    mlp_in_tiles: bool = False  # memory.tiled_mlp: the MLP keeps its input only (features/tiled_mlp)
    # data.packing "document": SDPA runs one document a call with no mask (run/attention.py), each call's
    # output written into one (b, s, heads, d) tensor; eager attention takes transformers' block-causal mask
    packed: bool = False

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _mask_bytes(ctx: ActContext, input_bytes: int) -> int:
    return input_bytes if ctx.cpu else BOOL


def _linear_inputs(
    spec: ModelSpec,
    ctx: ActContext,
    modules: list[tuple[str, int]],
    source: str,
    source_bytes: int,
    *,
    input_requires_grad: bool = True,
) -> list[SavedTensor]:
    """Inputs saved by the linears reading one tensor (`source`, in_features each).

    A linear saves its input only when its weight needs a gradient. Under autocast each call
    casts the (fp32) input to the compute dtype anew, and each cast is saved separately: casts
    of non-leaf tensors are not cached. Without autocast the one source tensor is shared.
    LoRA (PEFT's lora.Linear): dropout(x) saves a bool mask, lora_A saves its (cast) input
    and lora_B saves lora_A's output, r wide.
    """
    t, cb = ctx.tokens, ctx.compute_bytes
    out: list[SavedTensor] = []
    base_trainable = [(m, n) for m, n in modules if m in ctx.trainable_linears]
    if base_trainable:
        if ctx.autocast and source_bytes != cb:
            out += [SavedTensor(name=f"{m}.input", nbytes=t * n * cb, note="autocast copy") for m, n in base_trainable]
        else:
            n = base_trainable[0][1]
            out.append(
                SavedTensor(
                    name=f"{source} (input of {'/'.join(m for m, _ in base_trainable)})", nbytes=t * n * source_bytes
                )
            )
    in_bytes = ctx.adapter_bytes if not ctx.autocast else cb
    dropout = ctx.lora_dropout > 0 and ctx.dropout_active  # else nn.Identity (or eval): x itself
    # Without autocast, an input already in the adapters' dtype reaches every lora_A undropped and
    # uncast: one tensor, saved once however many adapters read it.
    shared = not dropout and not ctx.autocast and source_bytes == in_bytes
    targets = [(m, n) for m, n in modules if m in ctx.lora_targets]
    for i, (m, n) in enumerate(targets):
        if dropout and input_requires_grad:
            # PEFT casts x to the adapter dtype before dropout
            out.append(SavedTensor(name=f"{m}.lora_dropout.mask", nbytes=t * n * _mask_bytes(ctx, ctx.adapter_bytes)))
        if not shared:
            out.append(SavedTensor(name=f"{m}.lora_A.input", nbytes=t * n * in_bytes))
        elif i == 0:
            readers = "/".join(f"{x}.lora_A" for x, _ in targets)
            out.append(SavedTensor(name=f"{source} (input of {readers})", nbytes=t * n * in_bytes))
        out.append(SavedTensor(name=f"{m}.lora_B.input", nbytes=t * ctx.lora_r * (cb if ctx.autocast else in_bytes)))
    return out


def _trains(ctx: ActContext, projection: str) -> bool:
    """Whether a q/k/v projection's output requires grad on its own: its weight trains, or an
    adapter sits on it (a fused qkv_proj counts for all three)."""
    return any(m in ctx.trainable_linears or m in ctx.lora_targets for m in (projection, "qkv_proj", "c_attn"))


def _norm(name: str, spec: ModelSpec, ctx: ActContext, input_bytes: int) -> list[SavedTensor]:
    """RMSNorm saves its fp32 input (x.to(float32): a copy when x is 16-bit) and, when its weight
    trains, the normalized tensor. LayerNorm (native_layer_norm) saves its input plus fp32 mean
    and rstd per token."""
    t, h = ctx.tokens, spec.hidden_size
    if spec.norm == "layernorm":
        return [
            SavedTensor(name=f"{name}.input", nbytes=t * h * input_bytes),
            SavedTensor(name=f"{name}.mean+rstd", nbytes=2 * t * FP32),
        ]
    out = [
        SavedTensor(name=f"{name}.input (fp32)", nbytes=t * h * FP32),
        SavedTensor(name=f"{name}.rsqrt", nbytes=t * FP32),
    ]
    if ctx.norms_trainable:
        normed_bytes = FP32 if spec.model_type == "gemma2" else input_bytes
        out.append(SavedTensor(name=f"{name}.normalized", nbytes=t * h * normed_bytes))
    return out


def attention_saved(spec: ModelSpec, ctx: ActContext, *, input_requires_grad: bool = True) -> list[SavedTensor]:
    t, h, cb, rb = ctx.tokens, spec.hidden_size, ctx.compute_bytes, ctx.residual_bytes
    q_dim, kv_dim = spec.q_dim // ctx.tp, spec.kv_dim // ctx.tp
    heads = spec.num_heads // ctx.tp
    out: list[SavedTensor] = []
    norm_name = "ln_1" if spec.model_type == "gpt2" else "input_layernorm"
    if input_requires_grad:
        out += _norm(norm_name, spec, ctx, rb)
    norm_out_bytes = rb
    if spec.attn.fused_qkv:
        qkv = [(spec.layer_linears[0].module, h)]
    else:
        qkv = [("q_proj", h), ("k_proj", h), ("v_proj", h)]
    out += _linear_inputs(
        spec, ctx, qkv, f"{norm_name}.output", norm_out_bytes, input_requires_grad=input_requires_grad
    )
    # q, k after rotary: under autocast cos/sin are fp32 (they follow the fp32 hidden states), so
    # q_embed is fp32 and SDPA casts it back; the bf16 casts are what SDPA saves.
    qk_bytes = cb if ctx.autocast or spec.model_type == "gpt2" else rb
    # A fused qkv_proj (Phi-3) is split by slicing: V stays a view of the whole projection output,
    # so saving V keeps all of it (q and k are rotated into new tensors).
    if spec.attn.fused_qkv and spec.model_type != "gpt2":
        value_saved = SavedTensor(name="qkv_proj.output (kept by the value view)", nbytes=t * (q_dim + 2 * kv_dim) * cb)
    else:
        value_saved = SavedTensor(name="sdpa.value", nbytes=t * kv_dim * cb)
    if ctx.attention == "eager":
        s = ctx.seq
        scores = ctx.batch * heads * s * s
        kv_rep = q_dim  # repeat_kv materializes K and V at the full head count
        # A matmul saves each operand for the other's gradient: under LoRA the first layer's
        # input needs none, so only the projections that train make q, k or v require one.
        q_rg, k_rg, v_rg = (input_requires_grad or _trains(ctx, name) for name in ("q_proj", "k_proj", "v_proj"))
        scores_rg = q_rg or k_rg
        if k_rg:
            out.append(SavedTensor(name="attn.query", nbytes=t * q_dim * qk_bytes))
        if q_rg:
            out.append(SavedTensor(name="attn.key (repeated to all heads)", nbytes=t * kv_rep * qk_bytes))
        if scores_rg:
            out.append(SavedTensor(name="attn.value (repeated to all heads)", nbytes=t * kv_rep * cb))
        if spec.attn.softcap and scores_rg:  # Gemma-2: cap * tanh(scores / cap) saves the tanh
            out.append(SavedTensor(name="attn.softcap tanh output", nbytes=scores * cb, note="s^2 term"))
        # Llama-style eager attention takes softmax in fp32 and casts back (both saved); GPT-2's
        # softmax runs in the scores' dtype, which autocast promotes to fp32.
        softmax_bytes = FP32 if (ctx.autocast or spec.model_type != "gpt2") else cb
        if scores_rg or (v_rg and softmax_bytes == cb):
            out.append(SavedTensor(name="attn.softmax output", nbytes=scores * softmax_bytes, note="s^2 term"))
        if softmax_bytes != cb and v_rg:
            out.append(SavedTensor(name="attn.probs (cast to compute dtype)", nbytes=scores * cb, note="s^2 term"))
        if spec.attn.dropout > 0 and ctx.dropout_active:
            out += [
                SavedTensor(name="attn.dropout mask", nbytes=scores * _mask_bytes(ctx, cb), note="s^2 term"),
                SavedTensor(name="attn.dropout output", nbytes=scores * cb, note="s^2 term"),
            ]
    else:
        # On CUDA, flash attention takes 16-bit inputs with head_dim <= 256 and handles grouped
        # K/V itself; otherwise memory-efficient attention runs, which wants K and V repeated to
        # every head (saved so) and pads its logsumexp to a multiple of 32 positions.
        # Packed documents run the same kernel one document a call, with no mask (run/attention.py).
        efficient = not ctx.cpu and (qk_bytes == FP32 or spec.head_dim > 256)
        kv_saved = q_dim if efficient else max(kv_dim, ctx.cp * spec.head_dim) if ctx.cp > 1 else kv_dim
        if kv_saved != kv_dim:
            value_saved = SavedTensor(name="sdpa.value (repeated to all heads)", nbytes=t * q_dim * cb)
        lse_positions = -(-ctx.seq // 32) * 32 if efficient else ctx.seq
        out += [
            SavedTensor(name="sdpa.query", nbytes=t * q_dim * qk_bytes),
            SavedTensor(
                name="sdpa.key" + (" (repeated to all heads)" if kv_saved != kv_dim else ""),
                nbytes=t * kv_saved * qk_bytes,
            ),
            value_saved,
            SavedTensor(name="sdpa.output", nbytes=t * q_dim * cb),
            SavedTensor(name="sdpa.logsumexp (fp32)", nbytes=ctx.batch * heads * lse_positions * FP32),
        ]
    o_name = "c_proj" if spec.model_type == "gpt2" else "o_proj"
    # SDPA returns its output laid out (b, s, heads, d): the transpose + reshape feeding o_proj
    # is a view of the saved output. Eager attention's matmul output needs a contiguous copy, and
    # so does Phi-3's (its value is a strided view of the fused qkv output, and SDPA's output
    # follows that layout).
    if ctx.attention == "eager" or (spec.attn.fused_qkv and spec.model_type != "gpt2"):
        out += _linear_inputs(spec, ctx, [(o_name, q_dim)], "attn.output (contiguous copy)", cb)
    elif ctx.packed or ctx.cp > 1:  # SDPA's own output is saved; o_proj takes a new tensor assembled from it
        what = "the documents' outputs assembled" if ctx.cp == 1 else "all-to-all back to the rank's tokens"
        out += _linear_inputs(spec, ctx, [(o_name, q_dim)], f"attn.output ({what})", cb)
    else:  # only LoRA's own saved tensors are new
        shared = replace(ctx, trainable_linears=ctx.trainable_linears - {o_name})
        out += _linear_inputs(spec, shared, [(o_name, q_dim)], "sdpa.output", cb)
    if spec.resid_dropout > 0 and ctx.dropout_active:
        out.append(SavedTensor(name="attn.resid_dropout mask", nbytes=t * h * _mask_bytes(ctx, cb)))
    if spec.norms_per_layer == 4:  # Gemma-2: post_attention_layernorm normalizes the attention output
        out += _norm("post_attention_layernorm", spec, ctx, cb)
    return out


def mlp_saved(spec: ModelSpec, ctx: ActContext) -> list[SavedTensor]:
    t, h, cb, rb = ctx.tokens, spec.hidden_size, ctx.compute_bytes, ctx.residual_bytes
    out: list[SavedTensor] = []
    if spec.model_type == "gpt2":
        norm_name = "ln_2"
    elif spec.norms_per_layer == 4:
        norm_name = "pre_feedforward_layernorm"
    else:
        norm_name = "post_attention_layernorm"
    out += _norm(norm_name, spec, ctx, rb)
    if spec.mlp.num_experts:
        out += _experts_saved(spec, ctx)
    elif ctx.mlp_in_tiles:  # recomputed a tile at a time in backward from its input, which it keeps
        out.append(SavedTensor(name="the tiled MLP's input (post-attention norm output)", nbytes=t * h * rb))
    else:
        out += _dense_mlp_saved(spec, ctx, norm_name)
    if spec.resid_dropout > 0 and ctx.dropout_active:
        out.append(SavedTensor(name="mlp.resid_dropout mask", nbytes=t * h * _mask_bytes(ctx, cb)))
    if spec.norms_per_layer == 4:
        out += _norm("post_feedforward_layernorm", spec, ctx, cb)
    return out


def tiled_mlp_recompute(spec: ModelSpec, ctx: ActContext, tile_seq: int) -> int:
    """What one tile of a tiled MLP saves while its backward recomputes it (features/tiled_mlp): the dense MLP's
    saved tensors for `tile_seq` tokens of each row."""
    return total(_dense_mlp_saved(spec, replace(ctx, seq=tile_seq, mlp_in_tiles=False), "the tile's input"))


def _dense_mlp_saved(spec: ModelSpec, ctx: ActContext, norm_name: str) -> list[SavedTensor]:
    t, h, cb, rb = ctx.tokens, spec.hidden_size, ctx.compute_bytes, ctx.residual_bytes
    width = t * spec.intermediate_size // ctx.tp
    out: list[SavedTensor] = []
    if spec.mlp.kind == "dense":
        out += _linear_inputs(spec, ctx, [("c_fc", h)], f"{norm_name}.output", rb)
        act_saves = 4 if spec.mlp.act in ("gelu_new", "gelu_fast") else 1  # python tanh-GELU saves 4 tensors
        out.append(SavedTensor(name=f"act ({spec.mlp.act}) saved tensors", nbytes=act_saves * width * cb))
        down_name, down_in = "c_proj", "act output"
    else:
        if spec.mlp.fused_gate_up:
            out += _linear_inputs(spec, ctx, [("gate_up_proj", h)], f"{norm_name}.output", rb)
        else:
            out += _linear_inputs(spec, ctx, [("gate_proj", h), ("up_proj", h)], f"{norm_name}.output", rb)
        out += [
            SavedTensor(name="gate_proj.output (act input)", nbytes=width * cb),
            SavedTensor(name="up_proj.output", nbytes=width * cb),
            SavedTensor(name="act(gate) output", nbytes=width * cb),
        ]
        down_name, down_in = "down_proj", "act(gate) * up"
    return out + _linear_inputs(spec, ctx, [(down_name, spec.intermediate_size // ctx.tp)], down_in, cb)


def _experts_saved(spec: ModelSpec, ctx: ActContext) -> list[SavedTensor]:
    """A sparse MoE block (transformers 5's grouped-matmul experts): the router (a linear, fp32
    softmax, top-k, renormalization), each token's k rows gathered by expert, two grouped matmuls
    in the experts' own dtype, the routing-weight multiply, and the scatter back. Grouped matmuls
    save their input only when the expert weights train; the down projection's output is saved
    for the routing weights' gradient either way."""
    t, h, rb, cb = ctx.tokens, spec.hidden_size, ctx.residual_bytes, ctx.compute_bytes
    k, n_experts, xb = spec.mlp.experts_per_token or 1, spec.mlp.num_experts, ctx.expert_bytes
    rows, inter = k * t, spec.intermediate_size // ctx.tp
    trains = ctx.norms_trainable  # full fine-tuning: router and experts train
    out: list[SavedTensor] = []
    if trains:
        out.append(SavedTensor(name="router.input", nbytes=t * h * (cb if ctx.autocast else rb)))
        out.append(SavedTensor(name="experts.input (tokens gathered by expert)", nbytes=rows * h * xb))
    out += [
        SavedTensor(name="router softmax (fp32)", nbytes=t * n_experts * FP32),
        SavedTensor(name="router top-k indices", nbytes=t * k * INT64),
        SavedTensor(name="router top-k weights and their sum (fp32)", nbytes=t * (k + 1) * FP32),
        SavedTensor(name="routing permutations (3 index tensors)", nbytes=3 * rows * INT64),
        SavedTensor(name="experts' group offsets", nbytes=2 * n_experts * 4),
        SavedTensor(name="gate_up output (act input and up)", nbytes=rows * 2 * inter * xb),
        SavedTensor(name="act(gate) output", nbytes=rows * inter * xb),
        SavedTensor(name="down output (for the routing weights)", nbytes=rows * h * xb),
        SavedTensor(name="routing weights (fp32)", nbytes=rows * FP32),
    ]
    if trains:
        out.append(SavedTensor(name="down input (act(gate) * up)", nbytes=rows * inter * xb))
    return out


def layer_saved(spec: ModelSpec, ctx: ActContext, *, input_requires_grad: bool = True) -> list[SavedTensor]:
    """Everything one decoder layer saves for backward during one micro-batch."""
    if spec.layer_fit is not None:  # an architecture without hand-written terms (plan/derived.py)
        first = not input_requires_grad and spec.first_layer_fit is not None  # LoRA's first layer, measured
        fit = spec.first_layer_fit if first else spec.layer_fit
        name = "the first decoder layer, its input needing no gradient" if first else "decoder layer"
        name = f"{name} (derived from a trace of 1 and 2 layers)"
        return [SavedTensor(name=name, nbytes=fit.nbytes(ctx.batch, ctx.seq)), *packed_output_saved(spec, ctx)]
    return attention_saved(spec, ctx, input_requires_grad=input_requires_grad) + mlp_saved(spec, ctx)


def packed_output_saved(spec: ModelSpec, ctx: ActContext) -> list[SavedTensor]:
    """A derived architecture's packed documents: the attention output assembled from each document's call,
    which the output projection saves when it trains (a full fine-tune); its fit was traced on one document
    a row."""
    if not (ctx.packed or ctx.cp > 1) or ctx.attention == "eager" or not ctx.trainable_linears:
        return []
    nbytes = ctx.tokens * (spec.q_dim // ctx.tp) * ctx.compute_bytes
    return [SavedTensor(name="attn.output (the documents' outputs assembled)", nbytes=nbytes)]


def selective_kept(spec: ModelSpec, ctx: ActContext) -> list[SavedTensor]:
    """What a layer under selective checkpointing keeps beside its input (features/checkpointing/engine.py SAVED_OPS):
    the output of every matmul (each linear, LoRA's A and B) and of attention, in the compute dtype;
    the norms, activations, RoPE and adds are recomputed in backward. SDPA keeps its output and
    logsumexp; eager attention its two matmuls' outputs (the scores, b x heads x s^2, and the
    context). Dense layers only (resolve refuses MoE and derived terms)."""
    t, cb = ctx.tokens, ctx.compute_bytes
    heads = spec.num_heads // ctx.tp
    out: list[SavedTensor] = []
    for lin in spec.layer_linears:
        width = lin.out_features if lin.module in ROWWISE else lin.out_features // ctx.tp
        out.append(SavedTensor(name=f"{lin.module}.output", nbytes=t * width * cb))
        if lin.module in ctx.lora_targets:
            out.append(SavedTensor(name=f"{lin.module}.lora_A output", nbytes=t * ctx.lora_r * cb))
            out.append(SavedTensor(name=f"{lin.module}.lora_B output", nbytes=t * width * cb))
    if ctx.attention == "eager":
        out.append(SavedTensor(name="attn.scores", nbytes=ctx.batch * heads * ctx.seq * ctx.seq * cb, note="s^2 term"))
        out.append(SavedTensor(name="attn.context", nbytes=t * spec.q_dim // ctx.tp * cb))
    else:
        out += [s for s in attention_saved(spec, ctx) if s.name in ("sdpa.output", "sdpa.logsumexp (fp32)")]
    return out


def total(saved: list[SavedTensor]) -> int:
    return sum(s.nbytes for s in saved)


def head_saved(spec: ModelSpec, ctx: ActContext, lm_head_trainable: bool) -> list[SavedTensor]:
    """The final norm and the lm_head's saved input (on the last pipeline stage)."""
    name = "ln_f" if spec.model_type == "gpt2" else "norm"
    out = _norm(name, spec, ctx, ctx.residual_bytes)
    if lm_head_trainable:
        in_bytes = ctx.compute_bytes if ctx.autocast else ctx.residual_bytes
        out.append(SavedTensor(name="lm_head.input", nbytes=ctx.tokens * spec.hidden_size * in_bytes))
    return out


def logits_loss_bytes(spec: ModelSpec, ctx: ActContext, head_grad_bytes: int) -> dict[str, int]:
    """Logits and cross-entropy buffers at their forward and backward peaks.

    transformers' ForCausalLMLoss upcasts logits to fp32 (`logits.float()`, a no-op in fp32),
    pads and shifts the int64 labels, and calls cross_entropy = log_softmax (saves its fp32
    output) + nll_loss. Forward peak: logits + upcast + log-softmax output + labels. Backward
    starts with log-softmax output + nll_loss's dense gradient + log-softmax's gradient (3 fp32
    T x V buffers); the next moment, lm_head's backward, holds the logits gradient in the compute
    dtype and lm_head's weight gradient. The larger of the two is the backward peak; returned as
    "backward" plus "backward_grads" (the weight gradient counted in the gradients row).
    The training loop drops the model output before backward, so compute-dtype logits are gone.
    Gemma-2's final logit soft-capping adds tanh's saved output.
    Tensor parallelism: the head computes a vocabulary shard and gathers the logits whole on every
    tp rank (features/tensor_parallel), so the loss holds the whole vocabulary; the gradient lm_head's
    backward takes is its own shard's.
    """
    tv = ctx.tokens * spec.vocab_size
    shard = ctx.tokens * -(-spec.vocab_size // ctx.tp)
    cb = ctx.compute_bytes
    shifted_labels = ctx.tokens * 8  # saved by nll_loss
    padded_labels = ctx.batch * (ctx.seq + 1) * 8
    softcap = ("tanh's saved output (final logit soft-capping)", tv * cb if spec.model_type == "gemma2" else 0)
    fwd = Bytes(
        ("the logits", tv * cb),
        ("their fp32 upcast", tv * FP32 if cb != FP32 else 0),
        ("the log-softmax output (fp32)", tv * FP32),
        ("the int64 labels, padded and shifted", shifted_labels + padded_labels),
        softcap,
    )
    if ctx.tp > 1:  # the gather: the shard, the all-gather's stacked buffer and the concatenated logits
        gather = Bytes(
            ("the head's vocabulary shard of the logits", shard * cb),
            ("the all-gather's buffer (the tp shards stacked)", tv * cb),
            ("the logits gathered whole (the shards side by side)", tv * cb),
        )
        fwd = max(fwd, gather)
    loss_bwd = 3 * tv * FP32
    head_bwd = shard * cb + head_grad_bytes
    if loss_bwd >= head_bwd:  # nll_loss's backward has run and released the labels it saved
        three = ("the log-softmax output, its gradient and nll_loss's (3 fp32 tokens x vocab)", loss_bwd)
        return {"forward": fwd, "backward": Bytes(three, softcap), "backward_grads": 0}
    return {
        "forward": fwd,
        "backward": Bytes(
            ("the logits' gradient" + (" (this rank's vocabulary shard)" if ctx.tp > 1 else ""), shard * cb)
        ),
        "backward_grads": Bytes(("lm_head's weight gradient, formed as backward starts", head_grad_bytes)),
    }


def fused_loss_bytes(
    spec: ModelSpec, ctx: ActContext, *, chunk_tokens: int, head_trainable: bool, head_bytes: int
) -> dict[str, int]:
    """Buffers of run/loss.py's chunked fused linear cross-entropy, at its forward and backward peaks.

    Forward, inside one chunk: the shifted int64 targets; dL/dhidden for every token in the hidden
    dtype; dL/dW in the compute dtype (trainable head); the compute-dtype copy of a wider head
    weight (`head_bytes` its stored width); and one chunk's logits in fp32 beside their
    compute-dtype form, with the chunk's hidden rows cast to the compute dtype. Backward starts
    with dL/dhidden and dL/dW; the head's gradient has the head's dtype (a head stored wider than
    the compute dtype takes a copy of dL/dW): "backward_grads", counted in the gradients row.
    """
    tokens, vocab, hidden = ctx.tokens, spec.vocab_size, spec.hidden_size
    cb, hb = ctx.compute_bytes, ctx.residual_bytes
    rows = min(chunk_tokens, tokens)
    chunk = rows * vocab * (FP32 + (cb if cb != FP32 else 0)) + (rows * hidden * cb if hb != cb else 0)
    # per-row scalars beside them: int64 targets, bool mask, picked logit, max, sum, a temporary
    chunk += rows * (21 + (8 if cb == FP32 else 0))
    cast = vocab * hidden * cb if head_bytes != cb else 0
    grad_w = vocab * hidden * cb if head_trainable else 0
    grad_h = tokens * hidden * hb
    d_hidden = ("dL/dhidden for every token", grad_h)
    forward = Bytes(
        ("the int64 targets", tokens * 8),
        d_hidden,
        ("the head's dL/dW in the compute dtype", grad_w),
        ("the head's compute-dtype copy", cast),
        ("one chunk's logits and per-row scalars", chunk),
    )
    if not head_trainable:
        return {"forward": forward, "backward": Bytes(d_hidden), "backward_grads": 0}
    widened = head_bytes != cb  # dL/dW.to(weight dtype) is a new tensor beside the compute-dtype one
    return {
        "forward": forward,
        "backward": Bytes(
            d_hidden, ("the head's dL/dW in the compute dtype, beside its widened copy", grad_w * widened)
        ),
        "backward_grads": Bytes(("the head's weight gradient", vocab * hidden * head_bytes)),
    }


def step_inputs_bytes(spec: ModelSpec, ctx: ActContext) -> int:
    """Tensors every forward holds besides saved activations: the int64 input ids and labels, and
    the rotary cos/sin tables (1, s, head_dim) in the hidden-state dtype, saved by every layer.
    Packed documents add their int64 position ids, and the tables follow them, one per row. Under context
    parallelism the step's ids, labels (and position ids) are whole, the rank's cut of the labels shifted by one
    is its own, concat's positions one arange of the sequence, and the tables per row."""
    rows = ctx.batch if ctx.packed or ctx.cp > 1 else 1
    rotary = 0 if spec.model_type == "gpt2" else 2 * rows * ctx.seq * spec.head_dim * ctx.residual_bytes
    if ctx.cp == 1:
        return (3 if ctx.packed else 2) * ctx.tokens * 8 + rotary
    whole = ctx.tokens * ctx.cp
    positions = whole if ctx.packed else ctx.seq * ctx.cp
    return (2 * whole + positions + ctx.tokens) * 8 + rotary


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, recompute: str = "none") -> int:
    """Activation bytes per transformer layer, Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models"), 16-bit activations, GPT-style layer with
    dropout and a 4h GELU MLP.

    none:      sbh (10 + 24/t + 5as/(ht))    -- Eq. (2); t=1 gives 34sbh + 5as^2b
    selective: sbh (10 + 24/t)                -- Sec. 5 (attention core recomputed)
    full:      2sbh                           -- only the layer input is kept
    """
    if recompute == "full":
        return 2 * s * b * h
    per = 10 * s * b * h + 24 * s * b * h // t
    if recompute == "none":
        per += 5 * a * s * s * b // t
    elif recompute != "selective":
        raise ValueError(f"recompute must be none, selective or full (got {recompute!r})")
    return per


def kept_mask_bytes(ctx: ActContext, checkpointed: int, residual_bytes: int) -> int:
    """One 4-D (b, 1, s, s) mask the checkpoints keep for the recompute, to the backward of the last of
    its kind: eager attention's, in the hidden-state dtype (SDPA's packed documents run with none)."""
    if not checkpointed or ctx.attention != "eager":
        return 0
    return ctx.tokens * ctx.seq * residual_bytes


def attention_masks(spec: ModelSpec) -> int:
    """The 4-D masks transformers builds for eager attention: one per kind of layer (Gemma-2 always
    builds its full and its sliding-window mask; a config's layer_types names the kinds)."""
    kinds = spec.config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return len(set(map(str, kinds)))
    return 2 if spec.model_type == "gemma2" else 1
