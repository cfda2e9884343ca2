"""Context parallelism (parallel.cp): DeepSpeed-Ulysses' sequence parallelism (Jacobs et al. 2023,
arXiv 2309.14509), as DeepSpeed's ALST runs it for long-context fine-tuning (arXiv 2506.13996).

Each of the cp ranks of a data-parallel replica holds 1/cp of every sequence of the micro-batch (its ids,
position ids and shifted labels), and runs every layer on those tokens. Around attention, an all-to-all
gives each rank the whole sequence for 1/cp of the heads (key/value heads fewer than cp are repeated first),
and a second one returns the output to its sequence slice; the loss is each rank's sum over its tokens
divided by the step's tokens, summed over the cp ranks, so every rank reports what one process computes.
The gradients are averaged over the dp x cp ranks like data-parallel ones (DDP, ZeRO or FSDP2 over all of
them: the weights are replicated or sharded over dp x cp, as torchtitan's dp_shard_cp mesh).

Rank order: cp innermost, rank = data_index * cp + cp_index (ParallelDims.coords' dp index is the rank's
place among the weights' dp x cp replicas). The held-out evaluation through the chunked head (train.fused_loss)
is cut the same way and its sums added over the cp ranks; through transformers' own loss it runs whole sequences.
What does not compose yet is refused by name (spec/parallel.py for the layout, runnable here for the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError, NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims


def local_seq(r: Resolved) -> int:
    """The tokens of each sequence a rank runs its layers on in a training step: 1/cp of them (evaluation
    and generation run whole sequences)."""
    return r.batch.seq_len // r.dims.cp if r.training else r.batch.seq_len


def eval_seq(r: Resolved, fused: bool) -> int:
    """The tokens of each held-out row a rank's forward runs: 1/cp of them through the chunked head, else all."""
    return r.batch.seq_len // r.dims.cp if fused else r.batch.seq_len


def on(cfg: RunConfig) -> bool:
    return cfg.parallel.cp > 1


def active(r: Resolved) -> bool:
    return r.dims.cp > 1


def refuse(r: Resolved) -> None:
    """A sequence the cp ranks cannot share evenly; attention that is not SDPA (ParallelDims refuses the
    head counts and the layouts that do not compose)."""
    if r.dims.cp == 1:
        return
    cp, seq = r.dims.cp, r.batch.seq_len
    if seq % cp:
        raise ConfigError(
            "batch.seq_len",
            f"{seq} tokens do not split evenly over parallel.cp {cp} ranks",
            f"use a batch.seq_len that is a multiple of {cp} (e.g. {seq - seq % cp + cp})",
        )
    if r.training and r.attention == "eager":
        why = "requested" if r.spec.supports_sdpa else f"the only kind transformers has for {r.spec.model_type}"
        raise ConfigError(
            "memory.attention",
            f"context parallelism runs attention through SDPA (the whole sequence, 1/cp of the heads); eager is {why}",
            'set memory.attention = "auto" (or "sdpa"), or parallel.cp = 1',
        )


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if dims.cp == 1:
        return
    from trainplan.features import qlora, step_in_backward

    if cfg.mode == "inference":
        raise NotRunnable(
            "parallel.cp",
            "the engine splits training steps' sequences over the cp ranks; generation is planned, not run",
            "set parallel.cp = 1 for inference",
            what="inference under context parallelism",
        )
    untried = [
        ("mode", "QLoRA (bitsandbytes' 4-bit layers)", qlora.on(cfg)),
        ("train.step_in_backward", "the optimizer step in backward", step_in_backward.on(cfg)),
    ]
    for field, what, on_ in untried:
        if on_:
            raise NotRunnable.beside(field, what, "context parallelism", f"turn {field} off, or set parallel.cp = 1")


def untraceable(r: Resolved) -> str | None:
    return None
