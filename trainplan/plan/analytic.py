"""The analytic plan: closed-form bytes per component, per phase, per rank. Imports no torch.

Phases of a training step and what is live in each (torch semantics, zero_grad(set_to_none)):
  forward   weights, weight copies, optimizer states, persistent gradients, all saved
            activations, the loss's logits buffers
  backward  the same at the start of backward, where saved activations are all still live,
            plus the logits/loss gradients and the first gradients (lm_head)
  optimizer weights, all gradients, optimizer states and the step's temporaries
Gradients persist into forward when DDP keeps them in its buckets, when ZeRO-2 keeps its
partition, and whenever gradient accumulation spans more than one micro-batch.
"""

from __future__ import annotations

import dataclasses

from trainplan import config as C
from trainplan.plan import activations as A
from trainplan.plan.ledger import DeviceLedger, Ledger, gib
from trainplan.resolve import Resolved, resolve
from trainplan.spec.devices import DeviceSpec, MiB, host_memory_bytes, parse_size
from trainplan.spec.model import ModelSpec, ParamTensor
from trainplan.spec.parallel import ParallelDims
from trainplan.spec.precision import Precision

ROWWISE = frozenset({"o_proj", "down_proj", "c_proj"})  # TP shards their input dim
NF4_BYTES = 0.5
# bitsandbytes NF4 with double quantization: one 8-bit absmax per 64 weights, plus one fp32
# constant per 256 absmax blocks (Dettmers et al. 2023, QLoRA, Sec. 3).
NF4_CONSTANTS_BYTES = 1 / 64 + 4 / (64 * 256)
ZERO2_BUCKET_BYTES = 25 * MiB  # torch DDP's default bucket_cap_mb
BNB_8BIT_MIN_NUMEL = 4096  # bitsandbytes keeps 32-bit states for smaller tensors (min_8bit_size)
BNB_BLOCK = 256  # blockwise quantization of optimizer states, one fp32 absmax per block


# ---- per-rank tensors ----------------------------------------------------------------------


def _held(spec: ModelSpec, dims: ParallelDims, stage: int) -> list[ParamTensor]:
    """Parameter tensors a pipeline stage holds. A tied embedding lives on both end stages."""
    layers = dims.stage_layers(stage, spec.num_layers)
    first, last = stage == 0, stage == dims.pp - 1
    held = []
    for t in spec.tensors:
        if t.layer is not None:
            if t.layer in layers:
                held.append(t)
        elif t.role in ("embedding", "position"):
            if first or (t.role == "embedding" and last and spec.tie_word_embeddings):
                held.append(t)
        elif last:
            held.append(t)
    return held


def _tp_numel(t: ParamTensor, tp: int) -> int:
    if tp == 1 or t.role in ("norm", "router"):
        return t.numel
    if t.role == "bias" and t.module in ROWWISE:
        return t.numel
    return -(-t.numel // tp)


def _shard(numel_dim0: int, rest: int, n: int) -> int:
    """FSDP2 shards dim 0, padding it to a multiple of the shard count."""
    return -(-numel_dim0 // n) * rest


def _sharded_numel(t: ParamTensor, tp: int, dp: int) -> int:
    numel = _tp_numel(t, tp)
    if dp == 1:
        return numel
    dim0 = t.shape[0] if t.numel == numel else max(1, t.shape[0] // tp)
    return _shard(dim0, numel // max(dim0, 1), dp)


def _lora_shapes(spec: ModelSpec, r: int, targets: frozenset[str], layers: range, tp: int) -> list[tuple[int, ...]]:
    shapes = []
    for _ in layers:
        for lin in spec.layer_linears:
            if lin.module in targets:
                rowwise = lin.module in ROWWISE
                shapes.append((r, lin.in_features // (tp if rowwise else 1)))  # lora_A
                shapes.append((lin.out_features // (1 if rowwise else tp), r))  # lora_B
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- optimizer -------------------------------------------------------------------------------


def zero1_partition(shapes: list[tuple[int, ...]], world: int) -> list[list[tuple[int, ...]]]:
    """Which tensors' optimizer states each rank holds under torch's ZeroRedundancyOptimizer:
    largest first, each to the rank with the fewest elements so far (not an even split: one large
    embedding can put most of the states on one rank)."""
    parts: list[list[tuple[int, ...]]] = [[] for _ in range(world)]
    sizes = [0] * world
    for shape in sorted(shapes, key=_numel, reverse=True):
        i = sizes.index(min(sizes))
        parts[i].append(shape)
        sizes[i] += _numel(shape)
    return parts


def optimizer_state_bytes(name: str, shapes: list[tuple[int, ...]], state_bytes: int, cpu: bool) -> int:
    """Optimizer state for the trainable tensors `shapes`.

    AdamW: exp_avg + exp_avg_sq in the param dtype (Loshchilov & Hutter 2019; torch.optim.AdamW),
    plus a `step` scalar per tensor, kept on the CPU (fp32) unless capturable/fused.
    8-bit AdamW (bitsandbytes): two uint8 states + an fp32 absmax per 256-element block;
    tensors under 4096 elements keep 32-bit states. SGD with momentum: one buffer.
    Adafactor (torch.optim.Adafactor): factored second moment, row + column vectors for
    matrices, a full vector otherwise; no first moment.
    """
    steps = 4 * len(shapes) if cpu else 0
    numel = sum(_numel(s) for s in shapes)
    if name == "adamw":
        return 2 * numel * state_bytes + steps
    if name == "sgd":
        return 0
    if name == "sgd-momentum":
        return numel * state_bytes
    if name == "adamw-8bit":
        total = 0
        for s in shapes:
            n = _numel(s)
            total += 2 * n * 4 if n < BNB_8BIT_MIN_NUMEL else 2 * n + 2 * 4 * -(-n // BNB_BLOCK)
        return total + steps
    if name == "adafactor":
        total = 0
        for s in shapes:
            if len(s) >= 2:
                total += (_numel(s[:-1]) + _numel(s[:-2]) * s[-1]) * state_bytes
            else:
                total += _numel(s) * state_bytes
        return total + steps
    raise AssertionError(name)


def optimizer_temp_bytes(name: str, impl: str, shapes: list[tuple[int, ...]], state_bytes: int) -> int:
    """Temporaries alive inside optimizer.step().

    torch's foreach AdamW (the default on CUDA) computes sqrt(exp_avg_sq) for every tensor at
    once: one full-size temporary list (torch/optim/adamw.py, `_multi_tensor_adam`). The
    single-tensor loop (the default on CPU) holds sqrt() and its division for the largest
    tensor. Fused kernels need none.
    """
    if not shapes or name == "sgd" or impl == "fused":
        return 0
    if impl == "foreach":
        return sum(_numel(s) for s in shapes) * state_bytes if name.startswith("adamw") else 0
    if name not in ("adamw", "adafactor"):
        return 0
    # `denom = (exp_avg_sq.sqrt() / c).add_(eps)`: sqrt and quotient of this tensor, while the
    # previous tensor's denom is still bound to the loop variable.
    sizes = [_numel(s) * state_bytes for s in shapes]
    return max(2 * cur + prev for prev, cur in zip([0, *sizes[:-1]], sizes, strict=True))


# ---- one rank --------------------------------------------------------------------------------


def _rank_ledger(r: Resolved, rank: int) -> DeviceLedger:
    spec, cfg, prec, dims, batch = r.spec, r.cfg, r.precision, r.dims, r.batch
    device = r.devices[rank]
    stage, _, _ = dims.coords(rank)
    first, last = stage == 0, stage == dims.pp - 1
    layers = dims.stage_layers(stage, spec.num_layers)
    held = _held(spec, dims, stage)
    tp, dp = dims.tp, dims.dp
    mode = cfg.mode
    full = mode == "full"
    lora = mode in ("lora", "qlora")
    fsdp = dims.strategy in ("zero3", "fsdp-grad-op")
    shard_w = dp if fsdp else 1
    shard_g = dp if dims.strategy in ("zero2", "zero3", "fsdp-grad-op") else 1
    shard_o = dp if dims.strategy in ("zero1", "zero2", "zero3", "fsdp-grad-op") else 1
    cpu = device.kind == "cpu"
    cb = prec.compute_bytes
    # FSDP's MixedPrecisionPolicy replaces autocast: params are all-gathered in the compute
    # dtype, so the residual stream is 16-bit too. Under plain autocast the residual stream is
    # fp32 when the embedding's stored weight is (full fine-tuning); a frozen base is stored in
    # the compute dtype, so LoRA's residual stream is 16-bit.
    autocast = prec.autocast and not fsdp
    residual = 4 if (autocast and full) else cb
    explain: dict[str, str] = {}
    details: dict[str, list[tuple[str, int]]] = {}

    # weights
    trainable = held if full else []
    train_shapes = [_shape_tp(t, tp) for t in trainable]
    w_train = sum(_sharded_numel(t, tp, shard_w) for t in trainable) * prec.param_bytes
    frozen = [] if full else held
    quantized = [t for t in frozen if mode == "qlora" and t.role in ("linear", "expert")]
    w_quant = int(sum(_sharded_numel(t, tp, shard_w) for t in quantized) * (NF4_BYTES + NF4_CONSTANTS_BYTES))
    not_quantized = [t for t in frozen if t.role not in ("linear", "expert")] if quantized else frozen
    w_frozen = sum(_sharded_numel(t, tp, shard_w) for t in not_quantized) * prec.frozen_bytes
    weights = w_train + w_frozen + w_quant
    n_held = sum(_tp_numel(t, tp) for t in held)
    dtype_note = {4: "fp32", 2: prec.compute_dtype}
    if full:
        explain["weights"] = (
            f"{n_held / 1e6:,.1f}M params x {prec.param_bytes} B "
            f"({dtype_note[prec.param_bytes]}{' master' if prec.autocast else ''})"
            + (f" / {shard_w} shards" if shard_w > 1 else "")
        )
    else:
        explain["weights"] = (
            f"{n_held / 1e6:,.1f}M frozen base params in {dtype_note[prec.frozen_bytes]}"
            + (f", linear layers in NF4 ({NF4_BYTES + NF4_CONSTANTS_BYTES:.3f} B/param)" if quantized else "")
            + " — frozen, but still in the bill"
        )

    # weight copies
    copies_fwd = copies_bwd = 0
    if fsdp:
        per_layer_numel: dict[int, int] = {}  # one pass over the tensors, not one per layer
        for t in held:
            if t.layer is not None:
                per_layer_numel[t.layer] = per_layer_numel.get(t.layer, 0) + _tp_numel(t, tp)
        units = [per_layer_numel.get(i, 0) for i in layers]
        root = sum(_tp_numel(t, tp) for t in held if t.layer is None)
        if dims.strategy == "zero3":
            # The root unit (embedding, final norm, head) stays gathered from the first layer to the
            # loss; each decoder layer is gathered for its own forward and backward.
            copies_fwd = copies_bwd = (root + max(units, default=0)) * cb
            explain["weight_copies"] = (
                f"FSDP keeps the root unit ({root / 1e6:,.1f}M params) and one decoder layer "
                f"({max(units, default=0) / 1e6:,.1f}M) all-gathered in {prec.compute_dtype}"
            )
        else:
            copies_fwd = copies_bwd = n_held * cb
            explain["weight_copies"] = (
                "shard-grad-op keeps every unit unsharded from forward through "
                f"backward: {n_held / 1e6:,.1f}M params in {prec.compute_dtype}"
            )
    elif autocast and full:
        # Only matmul weights are cast: embedding lookups and norm multiplies run in fp32.
        cast = [
            t
            for t in trainable
            if t.role in ("linear", "bias", "router", "expert")
            or (t.role == "lm_head" and not r.fused_loss)  # the fused loss casts the head per call
            or (t.role == "embedding" and spec.tie_word_embeddings and last and not r.fused_loss)
        ]
        copies_fwd = copies_bwd = sum(_tp_numel(t, tp) for t in cast) * cb
        explain["weight_copies"] = (
            f"autocast caches a {prec.compute_dtype} copy of every trainable matmul weight from forward until "
            "backward ends"
        )
    elif quantized:
        big = max(_tp_numel(t, tp) for t in quantized)
        copies_fwd = copies_bwd = big * cb
        explain["weight_copies"] = f"the largest NF4 weight dequantized to {prec.compute_dtype} during its matmul"

    # LoRA adapter
    targets = frozenset(cfg.lora.target_modules) if lora else frozenset()
    lora_shapes = _lora_shapes(spec, cfg.lora.r, targets, layers, tp) if lora else []
    n_adapter = sum(_numel(s) for s in lora_shapes)
    adapter_w = -(-n_adapter // shard_w) * 4
    adapter_g = -(-n_adapter // shard_g) * 4
    _, dp_i, _ = dims.coords(rank)
    zero1 = dims.strategy == "zero1" and dp > 1  # the engine's ZeroRedundancyOptimizer partition
    if zero1:
        shard_o = 1
    lora_o_shapes = zero1_partition(lora_shapes, dp)[dp_i] if zero1 else lora_shapes
    adapter_o = optimizer_state_bytes(cfg.optim.name, lora_o_shapes, 4, cpu) // shard_o
    adapter_copy = n_adapter * cb if prec.autocast else 0
    if lora:
        explain["adapter"] = (
            f"LoRA r={cfg.lora.r} on {', '.join(sorted(targets))}: {n_adapter / 1e6:,.2f}M "
            "fp32 params, with their gradients and optimizer states"
        )

    # gradients and optimizer
    grads = sum(_sharded_numel(t, tp, shard_g) for t in trainable) * prec.grad_bytes
    shapes = zero1_partition(train_shapes, dp)[dp_i] if zero1 else train_shapes
    opt = optimizer_state_bytes(cfg.optim.name, shapes, prec.state_bytes, cpu) // shard_o if full else 0
    impl = cfg.optim.implementation
    if impl == "auto":
        impl = "for-loop" if cpu else "foreach"
    opt_temp_shapes = shapes if full else lora_o_shapes
    opt_temp = optimizer_temp_bytes(cfg.optim.name, impl, opt_temp_shapes, prec.state_bytes if full else 4) // shard_o
    if full:
        explain["gradients"] = f"{prec.grad_bytes} B per trainable param" + (
            f" / {shard_g} shards" if shard_g > 1 else ""
        )
        explain["optimizer"] = f"{cfg.optim.name} states in {dtype_note[prec.state_bytes]}" + (
            f" / {shard_o} shards" if shard_o > 1 else ""
        )
        if zero1:
            mine = sum(_numel(t) for t in shapes)
            explain["optimizer"] += (
                f" of the {len(shapes)} tensors ({mine / 1e6:,.1f}M params) ZeroRedundancyOptimizer gives "
                f"rank {dp_i}: largest first, to the least-loaded rank"
            )
    explain["optimizer_temp"] = f"{impl} {cfg.optim.name} step temporaries"
    persistent_grads = dims.strategy in ("ddp", "zero1", "zero2") or batch.grad_accum_steps > 1
    if persistent_grads and full:
        why = (
            "DDP keeps gradients in its buckets between steps"
            if dims.strategy in ("ddp", "zero1")
            else "ZeRO-2 keeps its gradient partition"
            if dims.strategy == "zero2"
            else "gradient accumulation keeps gradients across micro-batches"
        )
        explain["gradients"] += f"; live in forward too: {why}"
    head = next((t for t in trainable if t.role == "lm_head"), None) or (
        next((t for t in trainable if t.role == "embedding"), None) if spec.tie_word_embeddings else None
    )
    first_grads = (_sharded_numel(head, tp, shard_g) * prec.grad_bytes) if (head and last) else 0

    # host (offloaded optimizer)
    host_bytes = 0
    if dims.offload_optimizer:
        host_bytes = opt + opt_temp + grads + adapter_o
        explain["optimizer"] = "offloaded to host memory (see the host column)"
        opt = opt_temp = adapter_o = 0

    # activations
    t_micro = batch.micro_batch_size
    ctx = A.ActContext(
        batch=t_micro,
        seq=batch.seq_len,
        compute_bytes=cb,
        residual_bytes=residual,
        autocast=autocast,
        trainable_linears=frozenset(lin.module for lin in spec.layer_linears) if full else frozenset(),
        norms_trainable=full,
        lora_targets=targets,
        lora_r=cfg.lora.r,
        lora_dropout=cfg.lora.dropout,
        adapter_bytes=cb if fsdp else 4,  # FSDP2 gathers the adapters in its param dtype too
        attention=r.attention,
        cpu=cpu,
        dropout_active=r.training,
        tp=tp,
    )
    buffers = 0 if spec.model_type == "gpt2" else 2 * (spec.head_dim // 2) * 4  # rotary inv_freq (+ original)
    runtime = (
        cfg.hardware.cpu_runtime_mib if cpu else cfg.hardware.cuda_context_mib + cfg.hardware.cublas_workspace_mib
    ) * MiB
    comm_fwd = comm_bwd = 0
    if dims.pp > 1:
        comm_fwd = comm_bwd = 2 * ctx.tokens * spec.hidden_size * residual
    comm_end = comm_bwd
    if dims.strategy == "zero3":
        # the unsharded gradient of a layer before its reduce-scatter: only once layers run backward
        unit_grads = max(units, default=0) * prec.grad_bytes if full else 0
        comm_end += unit_grads
        if unit_grads:
            explain["comm_buffers"] = "the unsharded gradient of one FSDP unit before its reduce-scatter"
    elif dims.strategy == "zero2" and full:
        comm_end += min(ZERO2_BUCKET_BYTES, grads * shard_g)
        explain["comm_buffers"] = "one 25 MiB gradient bucket being reduced"

    if not r.training:
        return _inference_ledger(r, rank, device, held, layers, weights, buffers, runtime, explain)

    layer_list = list(layers)
    per_layer = A.layer_saved(spec, ctx)
    saved_layers = len(layer_list) * A.total(per_layer)
    if first and not full:  # the frozen embedding's output needs no grad: layer 0's first norm saves nothing
        saved_layers += A.total(A.layer_saved(spec, ctx, input_requires_grad=False)) - A.total(per_layer)
    fused = r.fused_loss and last
    head_saved = A.head_saved(spec, ctx, lm_head_trainable=full and not fused) if last else []
    in_flight = min(dims.pp - stage, batch.grad_accum_steps) if dims.pp > 1 else 1
    layer_in = ctx.tokens * spec.hidden_size * residual
    if cfg.memory.activation_checkpointing:
        act_fwd = in_flight * (len(layer_list) * layer_in + A.total(head_saved))
        act_bwd = act_fwd  # recomputation starts after the loss's backward; see backward_end
        explain["activations"] = (
            f"checkpointing keeps each layer's input ({gib(layer_in)}) x {len(layer_list)} "
            f"layers x {in_flight} micro-batch(es) in flight, plus one layer recomputed in "
            f"backward ({gib(A.total(per_layer))})"
        )
    else:
        act_fwd = in_flight * (saved_layers + A.total(head_saved))
        act_bwd = act_fwd
        top = max(per_layer, key=lambda s: s.nbytes)
        explain["activations"] = (
            f"{len(layer_list)} layers x {gib(A.total(per_layer))} saved per layer "
            f"(micro-batch {t_micro}, seq {batch.seq_len}) x {in_flight} micro-batch(es) "
            f"in flight; largest saved tensor {top.name} {gib(top.nbytes)}"
        )
    details["activations (one layer)"] = [(s.name, s.nbytes) for s in per_layer]
    head_grad = first_grads if (full and not persistent_grads) else 0
    if fused:
        logits = A.fused_loss_bytes(
            spec,
            ctx,
            chunk_tokens=cfg.train.loss_chunk_tokens,
            head_trainable=full,
            head_bytes=cb if fsdp else (prec.param_bytes if full else prec.frozen_bytes),
        )
    elif last:
        logits = A.logits_loss_bytes(spec, ctx, head_grad)
    else:
        logits = {"forward": 0, "backward": 0, "backward_grads": 0}
    step_inputs = A.step_inputs_bytes(spec, ctx)
    act_fwd += in_flight * step_inputs
    act_bwd += in_flight * step_inputs
    if last and (autocast or not full or fused):  # lm_head saved a cast, or nothing: the final hidden
        # state is still referenced by the model output during the loss
        act_fwd += ctx.tokens * spec.hidden_size * residual
    if fused:
        explain["logits_loss"] = (
            f"fused loss: {min(cfg.train.loss_chunk_tokens, ctx.tokens)} of {ctx.tokens} tokens' logits "
            f"at a time over {spec.vocab_size:,} vocab, plus the hidden-state gradient"
            + (" and the head weight's gradient" if full else "")
        )
    elif last:
        explain["logits_loss"] = (
            f"{ctx.tokens} tokens x {spec.vocab_size // tp:,} vocab: logits in "
            f"{prec.compute_dtype}, the fp32 upcast for the loss, log-softmax output "
            "and its gradients"
        )

    g_live_fwd = grads if (persistent_grads and full) else 0
    # Backward through the first layer: its saved tensors (recomputed under checkpointing) plus the
    # gradients of the MLP's intermediates (d product, d act, d up, d gate), in the compute dtype.
    first_layer_grads = 0
    if full and layer_list:
        # the embedding's gradient comes last, unless it is tied to lm_head, whose comes first
        in_first = [t for t in trainable if t.layer == layer_list[0]] + [
            t for t in trainable if t.role == "embedding" and not spec.tie_word_embeddings
        ]
        first_layer_grads = sum(_sharded_numel(t, tp, shard_g) for t in in_first) * prec.grad_bytes
    inter = spec.intermediate_size // tp * (spec.experts_per_token or 1)
    # By the time the MLP's input gradients are formed, down_proj's backward has released its input.
    down_in = ctx.tokens * inter * cb if full else 0
    first_layer_bwd = (
        A.total(A.layer_saved(spec, ctx, input_requires_grad=full)) - down_in + 4 * ctx.tokens * inter * cb + layer_in
    )  # + the residual stream's gradient
    if cfg.memory.activation_checkpointing and residual != 4:  # else the norm's fp32 input is the kept input
        first_layer_bwd += layer_in
    adapter_live = adapter_w + adapter_o + adapter_copy
    phases = {
        "forward": {
            "weights": weights,
            "weight_copies": copies_fwd,
            "adapter": adapter_live,
            "gradients": g_live_fwd,
            "optimizer": opt,
            "activations": act_fwd,
            "logits_loss": logits["forward"],
            "buffers": buffers,
            "comm_buffers": comm_fwd,
        },
        "backward": {
            "weights": weights,
            "weight_copies": copies_bwd,
            "adapter": adapter_live + (adapter_g if persistent_grads else 0),
            "gradients": g_live_fwd + logits["backward_grads"],
            "optimizer": opt,
            "activations": act_bwd,
            "logits_loss": logits["backward"],
            "buffers": buffers,
            "comm_buffers": comm_bwd,
        },
    }
    # The end of backward: the first layer's backward runs while every later gradient exists.
    # Whichever moment holds more is the backward peak.
    # autocast's weight copies are released layer by layer as backward consumes them
    end_copies = copies_bwd
    if autocast and full and not fsdp and layer_list:
        end_copies = sum(_tp_numel(t, tp) for t in cast if t.layer == layer_list[0]) * cb
    backward_end = {
        "weights": weights,
        "weight_copies": end_copies,
        "adapter": adapter_live + adapter_g,
        "gradients": max(g_live_fwd, grads - first_layer_grads),
        "optimizer": opt,
        "activations": first_layer_bwd + in_flight * step_inputs,
        "buffers": buffers,
        "comm_buffers": comm_end,
    }
    if fsdp and full and last and head is not None:
        # FSDP2 reduce-scatters the root unit's gradients in its final callback, after the whole
        # backward: the head's unsharded gradient (compute dtype) is still there at the end.
        backward_end["comm_buffers"] += head.numel * cb
    candidates = [phases["backward"], backward_end]
    if dims.strategy == "zero3":
        # The root unit is resharded after forward and gathered again as backward starts: its
        # all-gather output buffer and the unsharded parameters exist together for a moment.
        regather = dict(phases["backward"])
        regather["weight_copies"] = 2 * root * cb
        candidates.append(regather)
    if fused and layer_list and not cfg.memory.activation_checkpointing:
        # Without the logits buffers, the top layer's MLP backward can be the peak: every layer's
        # saved tensors, the MLP's intermediate gradients, and the gradients formed so far (head,
        # final norm, the top layer's down projection).
        top = layer_list[-1]
        formed = [
            t
            for t in trainable
            if (t.layer is None and t.role == "norm")
            or (t.layer == top and ".mlp." in t.name and t.module in ("down_proj", "c_proj"))
        ]
        formed_bytes = sum(_sharded_numel(t, tp, shard_g) for t in formed) * prec.grad_bytes
        top_down_in = ctx.tokens * inter * cb if full else 0
        top_layer = dict(backward_end)
        top_layer["gradients"] = g_live_fwd if persistent_grads and full else first_grads + formed_bytes
        top_layer["adapter"] = adapter_live + (adapter_g if persistent_grads else 0)
        top_layer["weight_copies"] = copies_bwd
        top_layer["comm_buffers"] = comm_bwd  # no unit has finished its backward yet
        if fsdp and full:  # gradients stay unsharded, in the compute dtype, until their unit's reduce-scatter
            top_layer["gradients"] = 0
            top_layer["comm_buffers"] += (head.numel + sum(t.numel for t in formed)) * cb
        if dims.strategy == "zero3" and len(layer_list) > 1:
            top_layer["weight_copies"] = copies_bwd + max(units, default=0) * cb  # the next unit, prefetched
        top_layer["activations"] = (
            in_flight * (saved_layers + step_inputs) - top_down_in + 3 * ctx.tokens * inter * cb + layer_in
        )
        candidates.append(top_layer)
        # An RMSNorm's backward: the final norm's (under LoRA, the top layer's input norm, after
        # that layer's adapter gradients): every layer's saved tensors, dL/dhidden and the norm's
        # fp32 (tokens x hidden) temporaries, 2 when the residual stream is fp32 and 4 when it is
        # upcast or under LoRA (counted on the trace, transformers 5.24's LlamaRMSNorm).
        temps = 4 if (residual != 4 or not full) else 2
        norm_bwd = dict(top_layer)
        norm_bwd["gradients"] = g_live_fwd if persistent_grads and full else first_grads
        norm_bwd["weight_copies"] = copies_bwd
        norm_bwd["comm_buffers"] = comm_bwd
        if fsdp and full:
            norm_bwd["gradients"] = 0
            norm_bwd["comm_buffers"] += head.numel * cb
        if not full and not persistent_grads:
            norm_bwd["adapter"] = adapter_live + adapter_g // len(layer_list)
        norm_bwd["activations"] = (
            in_flight * (saved_layers + step_inputs)
            + A.total(head_saved)
            + ctx.tokens * spec.hidden_size * (residual + temps * 4)
        )
        candidates.append(norm_bwd)
    if cfg.memory.activation_checkpointing and layer_list:
        # Checkpointing: the top layer is recomputed while every layer's kept input still exists.
        top_layer = dict(backward_end)
        top_layer["gradients"] = g_live_fwd + (first_grads if full and last else 0)
        top_layer["adapter"] = adapter_live + (adapter_g if persistent_grads else 0)
        top_layer["weight_copies"] = copies_bwd
        top_layer["activations"] = (
            first_layer_bwd + in_flight * step_inputs + in_flight * (len(layer_list) - 1) * layer_in
        )
        candidates.append(top_layer)
    phases["backward"] = max(candidates, key=lambda c: sum(c.values()))
    phases["optimizer"] = {
        "weights": weights,
        "adapter": adapter_w + adapter_o + adapter_g,
        "gradients": grads,
        "optimizer": opt,
        "optimizer_temp": opt_temp,
        "activations": 2 * ctx.tokens * 8,  # the batch (ids, labels) is still referenced
        "buffers": buffers,
    }
    return _device_ledger(r, rank, phases, runtime, explain, details, offload_bytes=host_bytes)


def _shape_tp(t: ParamTensor, tp: int) -> tuple[int, ...]:
    numel = _tp_numel(t, tp)
    if numel == t.numel:
        return t.shape
    return (t.shape[0], numel // t.shape[0]) if len(t.shape) > 1 else (numel,)


def _label(device: DeviceSpec, rank: int) -> str:
    return f"cpu {rank}" if device.kind == "cpu" else f"GPU {rank}"


def _role(dims: ParallelDims, rank: int) -> str:
    stage, dp_i, tp_i = dims.coords(rank)
    parts = []
    if dims.pp > 1:
        parts.append(f"stage {stage}/{dims.pp}")
    if dims.tp > 1:
        parts.append(f"tp {tp_i}")
    parts.append("single" if dims.strategy == "single" else dims.strategy)
    return ", ".join(parts) + f" rank {rank}"


def _device_ledger(
    r: Resolved, rank: int, phases: dict, runtime: int, explain: dict, details: dict, *, offload_bytes: int = 0
) -> DeviceLedger:
    device = r.devices[rank]
    led = DeviceLedger(
        label=_label(device, rank),
        device=device,
        role=_role(r.dims, rank),
        phases=phases,
        runtime_bytes=runtime,
        reserve_fraction=0.0 if device.kind == "cpu" else r.cfg.hardware.allocator_reserve,
        safety_margin=r.cfg.hardware.safety_margin,
        explain=explain,
        details=details,
        ranks=[rank],
        offload_bytes=offload_bytes,
    )
    _runtime_explain(led, r.cfg)
    return led


def _runtime_explain(led: DeviceLedger, cfg: C.RunConfig) -> None:
    if led.device.kind == "cpu":
        led.explain["runtime"] = (
            f"python + torch libraries, {cfg.hardware.cpu_runtime_mib} MiB (hardware.cpu_runtime_mib)"
        )
    else:
        led.explain["runtime"] = (
            f"CUDA context {cfg.hardware.cuda_context_mib} MiB + cuBLAS workspace "
            f"{cfg.hardware.cublas_workspace_mib} MiB (hardware.*_mib)"
        )
        led.explain["allocator_reserve"] = (
            f"{cfg.hardware.allocator_reserve:.0%} of peak allocated held by the "
            "caching allocator (hardware.allocator_reserve)"
        )


def _inference_ledger(
    r: Resolved,
    rank: int,
    device: DeviceSpec,
    held: list[ParamTensor],
    layers: range,
    weights: int,
    buffers: int,
    runtime: int,
    explain: dict[str, str],
) -> DeviceLedger:
    """Inference: weights + KV cache + the largest transient; no gradients, no optimizer."""
    spec, prec, batch, dims = r.spec, r.precision, r.batch, r.dims
    cb, tp = prec.compute_bytes, dims.tp
    stage, _, _ = dims.coords(rank)
    last = stage == dims.pp - 1
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
    # Two moments compete: inside the widest layer (residual, normed input, MLP gate/up/act), and
    # the loss (final hidden state, logits, their fp32 upcast and log-softmax, int64 labels).
    inputs = 2 * tokens * 8
    layer = 3 * tokens * h * cb + 3 * tokens * inter * cb
    vocab = -(-spec.vocab_size // tp)
    upcast = 4 if cb != 4 else 0  # logits.float() is a no-op on fp32 logits
    loss = tokens * h * cb + tokens * vocab * (cb + upcast + 4) + batch.micro_batch_size * (2 * batch.seq_len + 1) * 8
    if last and loss >= layer:
        transient, logits = tokens * h * cb + inputs, loss - tokens * h * cb
    else:
        transient, logits = layer + inputs, 0
    explain["kv_cache"] = (
        f"2 (K,V) x batch {batch.micro_batch_size} x context {batch.seq_len} x {len(layers)} layers "
        f"x {spec.num_kv_heads // tp} KV heads x head_dim {spec.head_dim} x {cb} B"
    )
    explain["activations"] = (
        "the batch and the working set of the widest moment (nothing is saved under inference_mode)"
    )
    if last:
        explain["logits_loss"] = "logits over the evaluated tokens, their fp32 upcast (none in fp32) and log-softmax"
    phases = {
        "inference": {
            "weights": weights,
            "activations": transient,
            "logits_loss": logits,
            "kv_cache": kv,
            "buffers": buffers,
        }
    }
    return _device_ledger(r, rank, phases, runtime, explain, {})


def kv_cache_bytes(*, batch: int, context: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for every layer: 2 x batch x context x layers x kv_heads x head_dim x bytes."""
    return 2 * batch * context * layers * kv_heads * head_dim * dtype_bytes


def model_state_bytes_per_param(precision: Precision, optimizer: str = "adamw") -> int:
    """Bytes per trainable parameter held between steps (weights + copy + grads + states).

    amp (fp32 master + autocast copy): 4 + 2 + 4 + 8 = 18, Hugging Face's "Anatomy of a
    model's memory". fp32: 16. Pure bf16: 2 + 2 + 4 = 8.
    """
    states = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}[optimizer] * precision.state_bytes
    copy = precision.compute_bytes if precision.autocast else 0
    return precision.param_bytes + copy + precision.grad_bytes + states


def zero_model_state_bytes(*, params: int, dp: int, stage: int, k: int = 12, low: int = 2) -> int:
    """ZeRO model states per GPU (Rajbhandari et al. 2020, Sec. 5.1 / Fig. 1): 16-bit weights and
    gradients (`low` bytes each), K bytes of fp32 master + Adam states per parameter.

    stage 0: (2 + 2 + K)Ψ; 1: 4Ψ + KΨ/N; 2: 2Ψ + (2 + K)Ψ/N; 3: (4 + K)Ψ/N.
    """
    p = params
    if stage == 0:
        return (2 * low + k) * p
    if stage == 1:
        return 2 * low * p + k * p // dp
    if stage == 2:
        return low * p + (low + k) * p // dp
    if stage == 3:
        return (2 * low + k) * p // dp
    raise ValueError(f"ZeRO stage must be 0-3 (got {stage})")


# ---- the whole plan --------------------------------------------------------------------------


def plan(cfg: C.RunConfig, spec: ModelSpec | None = None) -> Ledger:
    r = resolve(cfg, spec)
    cache: dict[tuple, DeviceLedger] = {}
    ledgers = []
    for rank, device in enumerate(r.devices):
        stage, dp_i, _ = r.dims.coords(rank)
        # ZeRO-1's partition is uneven: each data-parallel rank has its own bill
        key = (stage, device, dp_i if r.dims.strategy == "zero1" else 0)
        if key not in cache:
            cache[key] = _rank_ledger(r, rank)
        proto = cache[key]
        ledgers.append(
            dataclasses.replace(
                proto, label=_label(device, rank), device=device, role=_role(r.dims, rank), ranks=[rank]
            )
        )
    host = None
    if r.dims.offload_optimizer:
        host_cap = (
            parse_size(cfg.hardware.host_mem, "hardware.host_mem") if cfg.hardware.host_mem else host_memory_bytes()
        )
        host_dev = DeviceSpec(name="host RAM", kind="cpu", capacity_bytes=host_cap, bf16=True, peak_tflops=None)
        offloaded = sum(led.offload_bytes for led in ledgers)
        host = DeviceLedger(
            label="host",
            device=host_dev,
            role="offloaded optimizer (all ranks)",
            phases={"optimizer": {"optimizer": offloaded}},
            runtime_bytes=0,
            reserve_fraction=0.0,
            explain={
                "optimizer": "optimizer states, their step temporaries and a gradient copy of every rank on this node"
            },
        )
    b = r.batch
    settings = {
        "mode": cfg.mode,
        "precision": cfg.precision,
        "micro_batch_size": b.micro_batch_size,
        "grad_accum_steps": b.grad_accum_steps,
        "data_parallel": b.dp,
        "global_batch_size": b.global_batch_size,
        "seq_len": b.seq_len,
        "tokens_per_step": b.tokens_per_step,
        "parallel": r.dims.describe(),
        "strategy": r.dims.strategy,
        "tp": r.dims.tp,
        "pp": r.dims.pp,
        "optimizer": cfg.optim.name,
        "activation_checkpointing": cfg.memory.activation_checkpointing,
        "attention": r.attention,
        "lora": (
            {
                "r": cfg.lora.r,
                "alpha": cfg.lora.alpha,
                "dropout": cfg.lora.dropout,
                "target_modules": cfg.lora.target_modules,
            }
            if cfg.mode in ("lora", "qlora")
            else None
        ),
    }
    settings["summary"] = (
        f"{cfg.mode}, {cfg.precision}, micro-batch {b.micro_batch_size} x accum "
        f"{b.grad_accum_steps} x dp {b.dp} = global {b.global_batch_size}, seq {b.seq_len}, "
        f"{r.dims.describe()}"
        + (", activation checkpointing" if cfg.memory.activation_checkpointing else "")
        + f", {r.attention} attention"
    )
    notes = [
        "Analytic estimate from closed-form terms (docs/memory-model.md); `trainplan trace` runs the real "
        "model on fake tensors for the exact figure.",
    ]
    if r.spec.learned_positions == 0 and b.seq_len > r.spec.max_position_embeddings:
        notes.append(
            f"seq_len {b.seq_len} exceeds the model's max_position_embeddings "
            f"{r.spec.max_position_embeddings}: quality beyond it is not assured."
        )
    if any(d.kind == "cuda" for d in r.devices) and r.dims.world_size > 1:
        notes.append("NCCL's own buffers and per-peer channels are not in the bill yet.")
    return Ledger(model=r.spec.summary(), settings=settings, devices=ledgers, host=host, notes=notes)
