"""The plan from the data (`trainplan plan --data D`): the run's own micro-batches, not one fixed shape.

With `data.packing = "none"` a micro-batch is as wide as its longest row, so the step that holds the
longest documents decides the peak, and it may come hours in (transformers #13794, LLaMA-Factory
#3668). trainplan owns the sampler, deterministic by seed, so this replays it without the model:
tokenize the training split (cached, run/data.py), pack it as `train` does, walk the sampler's order
for every step of the run on every data-parallel rank, and plan the widest micro-batch's shape. Concat
and document packing fill every row to `batch.seq_len`: every step has the same shape, and the plan is
the fixed one, with the data's figures beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan import config as C
from trainplan.errors import ConfigError

if TYPE_CHECKING:
    from trainplan.plan.ledger import Ledger


def _percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def profile(cfg: C.RunConfig) -> dict:
    """The training split as `train` packs it, and the widest micro-batch of the run: its step (1-based),
    micro-batch in the accumulation window, data-parallel rank and (rows, tokens) shape."""
    from trainplan.resolve import resolve
    from trainplan.run import data, weights

    r = resolve(cfg)
    cache = data.cache_dir(cfg.model.cache_dir)
    docs, _ = data.load(cfg.data, cache=cache)
    packing = data.packing_of(docs, cfg.data.packing)
    seq = cfg.data.max_length if packing == "none" and cfg.data.max_length else r.batch.seq_len
    tokenizer = weights.load_tokenizer(cfg, r.spec)
    table = data.tokenized(docs, tokenizer, cache)
    packed = data.pack(docs, tokenizer, seq, r.spec.vocab_size, packing=packing, cache=cache, table=table)
    extra = 0 if tokenizer.eos_token_id is None else 1
    doc_tokens = sorted(int(n) + extra for n in table.data.column("input_ids").combine_chunks().value_lengths())
    b, dp, accum = r.batch.micro_batch_size, r.batch.dp, r.batch.grad_accum_steps
    n = packed.ids.shape[0]
    if n < b * dp:
        raise ConfigError(
            "batch.micro_batch_size",
            f"{b} per rank x {dp} rank(s) needs {b * dp} sequences at once, but the training split packs to {n}",
            "lower batch.micro_batch_size or batch.seq_len, or add data",
        )
    steps = cfg.train.steps
    if cfg.train.epochs:
        steps = data.steps_for_epochs(cfg.train.epochs, n, r.batch.global_batch_size)
    widest = {"step": 1, "micro_batch": 1, "rank": 0, "shape": [b, packed.ids.shape[1]]}
    if packed.lengths is not None:
        lengths = packed.lengths.tolist()
        grouped = cfg.data.group_by_length
        sampler = data.StatefulSampler(
            n, seed=cfg.train.seed, world=dp, lengths=lengths if grouped else None, group=b * dp * data.GROUP_MEGABATCH
        )
        best = 0
        for step in range(1, steps + 1):
            for j in range(1, accum + 1):
                rows = sampler.take_global(b)
                for rank in range(dp):
                    width = max(lengths[i] for i in rows[rank::dp])
                    if width > best:
                        best = width
                        widest = {"step": step, "micro_batch": j, "rank": rank, "shape": [b, width]}
    return {
        "packing": packing,
        "documents": len(docs),
        "document_tokens": {q: _percentile(doc_tokens, f) for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"max": doc_tokens[-1]},
        "sequences": n,
        "row_tokens": packed.ids.shape[1],
        "truncated_documents": packed.truncated,
        "packing_efficiency": round(packed.filled / packed.ids.numel(), 4),
        "tokens_per_epoch": packed.filled,
        "steps": steps,
        "widest": widest,
        "fixed_seq_len": r.batch.seq_len,
    }


def at_widest(cfg: C.RunConfig, prof: dict) -> C.RunConfig:
    """The run's config at the data's widest micro-batch: its tokens a row as batch.seq_len."""
    return cfg.at_seq_len(prof["widest"]["shape"][1])


def plan(cfg: C.RunConfig) -> Ledger:
    """The analytic plan at the data's widest micro-batch, with the data's figures on the ledger."""
    from trainplan.plan import analytic

    prof = profile(cfg)
    width = prof["widest"]["shape"][1]
    ledger = analytic.plan(at_widest(cfg, prof))
    ledger.data = prof
    w = prof["widest"]
    if prof["packing"] == "none":
        ledger.notes.append(
            f"planned at the data's widest micro-batch: step {w['step']} (micro-batch {w['micro_batch']}, rank "
            f"{w['rank']}), {w['shape'][0]} rows x {width} tokens; a fixed plan at batch.seq_len "
            f"{prof['fixed_seq_len']} would plan {prof['fixed_seq_len']} tokens a row"
        )
    return ledger
