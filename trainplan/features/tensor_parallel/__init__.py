"""Tensor parallelism (parallel.tp): Megatron's split of every decoder layer across the tp ranks of a
data-parallel replica. The attention's q/k/v and the MLP's gate/up projections are split by output
(column-wise), o and down by input (row-wise, one all-reduce each), so a rank holds 1/tp of the heads
and of the intermediate width; the embedding is split by vocabulary; the head is split by vocabulary
and its logits are gathered whole on every tp rank for the loss (torchtitan's layout with its
vocabulary-parallel loss turned off); the norms are replicated. Alone, or 2-D under FSDP2 on the
data-parallel axis of a (dp, tp) mesh."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import NotRunnable
from trainplan.features import activation_offload, optim8bit, optimizer_offload, qlora, step_in_backward

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

# The architectures whose decoder layers the engine splits: separate q/k/v/o and gate/up/down
# projections with these names, heads reshaped from the projection's own width (so a rank's share of
# the heads needs no change to the attention code); Gemma-2's scaled embedding keeps its scale
# (engine.py `_vocab_parallel_forward`). Mixtral's experts are split by the intermediate width, their
# fused [gate; up] packed (engine.py `experts`), its router replicated. Phi-3's fused [q; k; v] and
# [gate; up] are packed too (engine.py `packed_column`), which takes equal parts: not under grouped
# heads (q wider than k and v). GPT-2's Conv1D is not a Linear.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "phi3")
PACKED_TYPES = ("mixtral", "phi3")  # a packed split: not under FSDP2 (2-D)
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
PACKED = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}  # fused column-wise projections: their parts
EXPERTS, ROUTER = "mlp.experts", "mlp.gate"  # a sparse mixture block's (transformers 5's names)


def on(cfg: RunConfig) -> bool:
    return cfg.parallel.tp > 1


def active(r: Resolved) -> bool:
    return r.dims.tp > 1


def refuse(r: Resolved) -> None:
    """ParallelDims refuses a tp that does not divide the world or the heads (spec/parallel.py)."""


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if dims.tp == 1:
        return
    if qlora.on(cfg):
        raise NotRunnable(
            "parallel.tp",
            "QLoRA's 4-bit base layers (bitsandbytes) are not DTensors, so tensor parallelism cannot split them",
            'use mode = "lora" with parallel.tp, or parallel.tp = 1 with QLoRA',
            what="QLoRA under tensor parallelism",
        )
    # what the engine has not run beside the tp split: each refused by name
    untried = [
        ("optim.name", "8-bit AdamW (bitsandbytes' states are not DTensors)", optim8bit.on(cfg)),
        ("parallel.offload_optimizer", "optimizer offload", optimizer_offload.on(cfg)),
        ("memory.offload_activations", "activation offload", activation_offload.on(cfg)),
        ("train.step_in_backward", "the optimizer step in backward", step_in_backward.on(cfg)),
    ]
    for field, what, on_ in untried:
        if on_:
            fix = f"turn {field} off with parallel.tp, or set parallel.tp = 1"
            raise NotRunnable.beside(field, what, "tensor parallelism", fix)
    if dims.dp > 1 and not dims.shards_params:
        raise NotRunnable(
            "parallel.strategy",
            f"{dims.strategy} replicates the model over the data-parallel ranks, and the engine runs tensor "
            "parallelism 2-D under FSDP2 only",
            'set parallel.strategy = "zero3" (or "fsdp-grad-op") with parallel.tp',
            what=f"{dims.strategy} with tensor parallelism",
        )


def runnable_model(model_type: str, dims: ParallelDims, *, grouped_kv: bool = False) -> None:
    """The architectures the engine splits (MODEL_TYPES), asked once the model's type is known
    (grouped_kv: fewer key/value heads than query heads)."""
    if model_type in PACKED_TYPES and dims.dp > 1:
        what = "a mixture's [gate; up] experts" if model_type == "mixtral" else "Phi-3's fused projections"
        raise NotRunnable(
            "parallel.tp",
            f"FSDP2 over a packed tp split of {what} is not built (the engine splits them over tp alone)",
            "use parallel.tp alone (dp 1), or FSDP2 alone (parallel.tp = 1)",
            what=f"2-D FSDP2 x tp on {model_type}",
        )
    if model_type == "phi3" and grouped_kv:
        raise NotRunnable(
            "parallel.tp",
            "Phi-3's fused qkv_proj under grouped-query attention holds q, k and v of unequal widths, which the "
            "engine's packed split (equal parts) cannot share out by heads",
            'set parallel.tp = 1 (FSDP2, parallel.strategy = "zero3", shards any model)',
            what="tensor parallelism on Phi-3 with grouped-query attention",
        )
    if model_type not in MODEL_TYPES:
        raise NotRunnable(
            "parallel.tp",
            f"the engine splits the decoder layers of {', '.join(MODEL_TYPES)} models; this one is {model_type!r}",
            'set parallel.tp = 1 (FSDP2, parallel.strategy = "zero3", shards any model)',
            what=f"tensor parallelism on {model_type}",
        )


def untraceable(r: Resolved) -> None:
    """The trace runs rank 0 of tp with its peers faked (plan/traced.py): the head's gather is the engine's
    own all-gather into a buffer it allocates (engine.py gather_vocab), so the fake collectives allocate
    what a real one does (torch's funcol gather, used before, held T x V more: +23 % in forward)."""
    return None
