"""The run around the step: loading the weights, evaluating held-out data, saving the result.

Each is a phase of the ledger beside forward, backward and optimizer, so the verdict is the
maximum over the whole run and names the phase where it peaks. Imports no torch.

  load      run/weights.py copies the weights tensor by tensor from the memory-mapped file into the
            model's own storage: the model as stored, plus one tensor in flight where the path needs
            one. FSDP materializes each full tensor on the device before it is scattered; a random
            initialization under FSDP allocates the tied embedding's shard twice before re-tying (measured); QLoRA
            moves a 16-bit linear to the device and packs it there (on the CPU every 16-bit linear
            is already there when packing begins). Random initialization allocates the model alone.
  evaluate  run/evaluate.py after training steps: what persists between steps (weights, optimizer
            states, persistent gradients) and a forward under no_grad over one held-out micro-batch,
            which saves nothing for backward: the widest layer's working set, or the loss moment
            (logits, their fp32 copy, log-softmax).
  save      run/result.py at the end: what persists between steps, plus what the strategy gathers.
            Without sharding the tensors are written as they are (to the host from a GPU). FSDP
            all-gathers each tensor in full, one at a time; where the device is the host (CPU
            ranks), rank 0 keeps every gathered tensor for the state dict it writes.
"""

from __future__ import annotations

from trainplan import features
from trainplan.plan import terms as T
from trainplan.plan.formulas import kv_cache_bytes
from trainplan.plan.parts import Bytes
from trainplan.plan.tensors import NF4_BYTES, NF4_CONSTANTS_BYTES

# DTensor.full_tensor() while get_model_state_dict gathers one tensor: the all-gather's output, the
# functional collective's copy and the unpadded result: 3 full-size buffers at once (measured with
# the storage tracker on 2 gloo ranks; NCCL not yet measured). The main rank's host copy is a 4th.
GATHER_COPIES = 3
SHARD_BYTES = 5 * 10**9  # run/result.py's max_shard_size: the largest piece safetensors serializes at once


def _held_bytes(ctx: T.RankContext) -> int:
    return ctx.prec.param_bytes if ctx.full else ctx.prec.frozen_bytes


def load(ctx: T.RankContext, weights: T.Term, adapter: T.AdapterTerm, buffers: int) -> tuple[dict[str, int], str]:
    """The load phase: the model as stored, the adapters, and the tensor in flight."""
    prec = ctx.prec
    if ctx.quantized and ctx.cpu:
        numel = ctx.tensors.numel("quantizable", ctx.tp)
        in_flight = int(numel * (prec.frozen_bytes - NF4_BYTES - NF4_CONSTANTS_BYTES))
        note = "every 16-bit linear is on the CPU before packing begins, in place of its NF4 form"
    elif ctx.quantized:
        in_flight = ctx.tensors.largest("quantizable", ctx.tp) * prec.frozen_bytes
        note = f"the largest linear in {ctx.dtype(prec.frozen_bytes)} on the device while it is packed to NF4"
    elif ctx.shards.fsdp and ctx.r.spec.tie_word_embeddings and ctx.tensors.select("embedding"):
        embedding = ctx.tensors.largest("embedding", ctx.tp)
        in_flight = -(-embedding // ctx.shards.w) * _held_bytes(ctx)
        note = "a second shard of the tied embedding: FSDP2 allocates it for both modules before they are re-tied"
    else:
        in_flight = 0
        note = "copied from the memory-mapped file straight into each parameter: nothing beside the model"
    copies = Bytes((f"the load's tensor in flight: {note}", in_flight))
    phase = {"weights": weights.nbytes, "weight_copies": copies, "adapter": adapter.weights, "buffers": buffers}
    return phase, note


def forward_working_set(ctx: T.RankContext) -> tuple[int, int, int, int]:
    """A forward that saves nothing (inference_mode or no_grad): (inputs, widest layer's working
    set, loss moment). The layer: residual, normed input, the MLP's gate, up and activation. The
    loss through the chunked head: the shifted targets, the final hidden state, the head's
    compute-dtype copy and one chunk's logits. Otherwise: logits, their fp32 copy (none when
    already fp32, but then reshape copies a strided slice), log-softmax, and the labels. The fourth:
    tensor parallelism's gather of the logits inside the head (its shard, the all-gather's stacked
    buffer, the concatenated logits), 0 without it."""
    spec, batch, cb, tp = ctx.spec, ctx.batch, ctx.cb, ctx.tp
    mb = batch.micro_batch_size
    seq = features.context_parallel.eval_seq(ctx.r, ctx.fused)  # context parallelism cuts the chunked head's
    tokens = mb * seq
    whole = mb * batch.seq_len
    inputs = 2 * whole * 8 + (whole * 8 + tokens * 8 if seq != batch.seq_len else 0)  # + the cut's shifted labels
    h, inter = spec.hidden_size, spec.intermediate_size // tp
    mlp_tokens = ctx.mlp_tokens_at(mb, seq)  # the tiled MLP runs a tile at a time, into one output
    layer = 3 * tokens * h * cb + 3 * mlp_tokens * inter * cb + (tokens * h * cb if mlp_tokens != tokens else 0)
    if not ctx.last:
        return inputs, layer, 0, 0
    vocab = spec.vocab_size  # tensor parallelism gathers the logits whole (features/tensor_parallel)
    if ctx.fused:  # run/loss.py's chunked head: one chunk's logits at a time, as in training
        head_bytes = cb if ctx.shards.fsdp else _held_bytes(ctx)
        rows = min(ctx.cfg.train.loss_chunk_tokens, tokens)
        cast = vocab * h * cb if head_bytes != cb else 0
        chunk = rows * vocab * (4 + (cb if cb != 4 else 0)) + (rows * h * cb if ctx.residual != cb else 0)
        return inputs, layer, tokens * 8 + tokens * h * ctx.residual + cast + chunk + rows * 32, 0
    copy = 4 if cb != 4 or mb > 1 else 0
    loss = tokens * vocab * (cb + copy + 4) + mb * (2 * batch.seq_len + 1) * 8
    gather = tokens * (-(-vocab // tp) + 2 * vocab) * cb if tp > 1 else 0
    return inputs, layer, loss, gather


def evaluate(
    ctx: T.RankContext,
    weights: T.Term,
    copies: T.Term,
    adapter: T.AdapterTerm,
    grads: T.GradTerm,
    opt: T.OptTerm,
    buffers: int,
    comm: T.CommTerm,
) -> tuple[dict[str, int], str]:
    """Evaluation between or after training steps."""
    inputs, layer, loss, gather = forward_working_set(ctx)
    copies_at_loss = copies.nbytes
    if ctx.shards.fsdp and ctx.dims.reshard_after_forward and not ctx.fused:
        # the loss is taken outside the model's no_grad forward, after FSDP2 resharded its root unit: the
        # loss moment holds no gathered copy; the tp head's gather, inside the forward, does
        copies_at_loss = 0
    if gather + copies.nbytes > loss + copies_at_loss:
        loss, copies_at_loss = gather, copies.nbytes
    phase = {
        "weights": weights.nbytes,
        "weight_copies": copies.nbytes if loss < layer else copies_at_loss,
        "adapter": adapter.live,
        "gradients": _between_steps(ctx, grads),
        "optimizer": opt.states,
        "activations": Bytes(
            ("the held-out batch's ids and labels", inputs),
            ("the widest layer's working set under no_grad", 0 if loss >= layer else layer),
        ),
        "logits_loss": Bytes(("the evaluation's loss moment under no_grad", loss if loss >= layer else 0)),
        "buffers": buffers,
        "comm_buffers": comm.steady,
    }
    note = (
        "a no_grad forward over one held-out micro-batch beside what persists between steps; "
        + ("the loss moment is its widest" if loss >= layer else "its widest layer")
        + (f" (the chunked head: {ctx.cfg.train.loss_chunk_tokens} tokens' logits at a time)" if ctx.fused else "")
    )
    return phase, note


def save(
    ctx: T.RankContext,
    weights: T.Term,
    adapter: T.AdapterTerm,
    grads: T.GradTerm,
    opt: T.OptTerm,
    buffers: int,
) -> tuple[dict[str, int], str]:
    """Saving the result: the state after the last step, plus what the strategy gathers."""
    prec = ctx.prec
    gathered, note = 0, "written as it is (from a GPU, copied to the host a tensor at a time)"
    if ctx.shards.fsdp or ctx.tp > 1:  # the DTensors are gathered whole (tp's shards too)
        if ctx.full:
            saved, largest, nbytes = ctx.tensors.numel("held", 1), ctx.tensors.largest("held", 1), prec.param_bytes
        else:
            saved, largest, nbytes = T.lora_numel(ctx), T.lora_numel(ctx, largest=True), 4
        largest *= nbytes
        # one rank (offload on one device): the full tensors are its own
        if ctx.cpu and ctx.shards.w == 1 and ctx.tp == 1:
            note = "one rank: the full state dict is the parameters themselves, on the host already"
        elif ctx.cpu and ctx.rank == 0:
            # each gathered tensor is kept, so the one being gathered adds its other buffers to what is
            # kept: at most the largest's, gathered last (an untied head). A tied head's key gathers the
            # embedding a second time beside its first copy (measured on 2 gloo ranks, tp and FSDP2).
            tied = ctx.tensors.largest("embedding", 1) * nbytes if ctx.full and ctx.spec.tie_word_embeddings else 0
            gathered = saved * nbytes + max((GATHER_COPIES - 1) * largest, GATHER_COPIES * tied)
            note = (
                "rank 0 gathers every tensor in full and keeps them, on the host, for the file it writes; "
                f"the tensor being gathered is held {GATHER_COPIES} times over meanwhile"
                + (", and the tied head's key gathers the embedding again" if tied else "")
            )
        else:
            gathered = GATHER_COPIES * largest
            note = f"each tensor gathered in full, one at a time, {GATHER_COPIES} buffers of it at once" + (
                "" if ctx.cpu else ", then copied to the host"
            )
        if ctx.shards.fsdp and ctx.tp > 1 and gathered:  # 2-D: over dp first, then tp
            gathered += largest // ctx.tp
            note += "; 2-D, gathered over dp first: its tp shard held meanwhile"
    phase = {
        "weights": weights.nbytes,
        "weight_copies": Bytes((f"saving: {note}", gathered)),
        "adapter": adapter.weights + adapter.states,
        "gradients": _between_steps(ctx, grads),
        "optimizer": opt.states,
        "buffers": buffers,
    }
    return phase, note


def _between_steps(ctx: T.RankContext, grads: T.GradTerm) -> int:
    """Gradients that exist between optimizer steps (evaluation, saving): DDP's buckets and ZeRO-2's
    partition stay allocated; otherwise zero_grad(set_to_none) has freed them, accumulated or not."""
    return grads.live_fwd if ctx.dims.keeps_grads_between_steps else 0


def inference(ctx: T.RankContext, weights: int, buffers: int, explain: dict, noted: dict) -> dict[str, int]:
    """The inference phase: weights (and FSDP2's gathered units), the KV cache and the widest transient:
    inside the widest layer (residual, normed input, MLP gate/up/act) or the loss (final hidden state,
    logits, their fp32 upcast and log-softmax, int64 labels). Nothing is saved under inference_mode."""
    from trainplan.features.sharding import plan as sharding

    spec, batch, layers, last = ctx.spec, ctx.batch, ctx.layers, ctx.last
    cb, tp = ctx.cb, ctx.tp
    tokens = batch.micro_batch_size * batch.seq_len
    kv = kv_cache_bytes(
        batch=batch.micro_batch_size,
        context=batch.seq_len,
        layers=len(layers),
        kv_heads=spec.num_kv_heads // tp,
        head_dim=spec.head_dim,
        dtype_bytes=cb,
    )
    h, inter = spec.hidden_size, spec.intermediate_size // tp
    inputs = 2 * tokens * 8
    layer = 3 * tokens * h * cb + 3 * tokens * inter * cb
    vocab = spec.vocab_size  # tensor parallelism gathers the logits whole (features/tensor_parallel)
    upcast = 4 if cb != 4 else 0  # logits.float() is a no-op on fp32 logits
    loss = tokens * h * cb + tokens * vocab * (cb + upcast + 4) + batch.micro_batch_size * (2 * batch.seq_len + 1) * 8
    if tp > 1:  # the head's gather: its shard, the all-gather's stacked buffer, the concatenated logits
        loss = max(loss, tokens * h * cb + tokens * (-(-vocab // tp) + 2 * vocab) * cb)
    if last and loss >= layer:
        transient = Bytes(("the batch's ids and labels", inputs), ("the final hidden state", tokens * h * cb))
        logits = loss - tokens * h * cb
    else:
        transient, logits = Bytes(("the batch's ids and labels", inputs), ("the widest layer's working set", layer)), 0
    copies = 0
    if sharding.defers_buffers(ctx):  # the units' gathered copies at the widest of FSDP2's moments
        hidden = tokens * h * cb
        copies, transient, logits = sharding.inference_moment(
            ctx, inputs=inputs, layer=layer, hidden=hidden, logits=loss - hidden
        )
    elif ctx.shards.fsdp:  # without resharding (or on one rank) every unit stays gathered
        copies = Bytes(("every unit gathered", ctx.n_held * cb))
    noted |= {"kv_cache": kv, "logits_loss": logits}
    explain["kv_cache"] = (
        f"2 (K,V) x batch {batch.micro_batch_size} x context {batch.seq_len} x {len(layers)} layers "
        f"x {spec.num_kv_heads // tp} KV heads x head_dim {spec.head_dim} x {cb} B"
    )
    explain["activations"] = (
        "the batch and the working set of the widest moment (nothing is saved under inference_mode)"
    )
    if last:
        explain["logits_loss"] = "logits over the evaluated tokens, their fp32 upcast (none in fp32) and log-softmax"
    return {
        "weights": weights,
        "weight_copies": copies,
        "activations": transient,
        "logits_loss": logits,
        "kv_cache": kv,
        "buffers": buffers,
    }
