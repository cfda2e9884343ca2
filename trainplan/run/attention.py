"""Causal attention over packed documents without an (s x s) mask, and the hook context parallelism uses.

transformers builds a block-causal (b, 1, s, s) mask for packed documents (position ids restarting at 0) and
SDPA then runs its math kernel on it: 2 GiB a layer at 32K tokens in bf16, 512 GiB at 512K. Here each document
runs causal SDPA in its own call with no mask, so the memory-efficient kernels serve (CUDA's flash or
memory-efficient attention; the CPU's flash kernel, `_scaled_dot_product_flash_attention_for_cpu`) and nothing
of size s x s exists at any moment. Registered with transformers' AttentionInterface as IMPLEMENTATION and with
no mask function, so the model's mask code returns None for it (masking_utils._preprocess_mask_arguments).

Where the documents are: the position ids each layer is given restart at 0 at each document. Two callers set
them instead (`documents(...)`, `set_layout`): context parallelism, whose ranks hold a slice of each sequence
while attention sees all of it, with its `Exchange`, the all-to-all pair around the kernel
(features/context_parallel/engine.py); and the trace, whose fake position ids hold no values. The model's
forward pre-hook (`install`) reads them from its own arguments too, for a layer that is not given them.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from trainplan.errors import TrainplanError

IMPLEMENTATION = "trainplan_sdpa"  # the name transformers' config carries (no "/": that names a hub kernel)


class Exchange(Protocol):
    """Context parallelism's pair of all-to-alls: (b, heads, s/cp, d) -> (b, heads/cp, s, d) and back."""

    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Layout:
    """What attention needs beyond q, k and v: each row's document lengths (whole sequence), the exchange."""

    lengths: tuple[tuple[int, ...], ...] | None = None  # per row; None: one document a row
    exchange: Exchange | None = None
    source: weakref.ref | None = None  # the position ids the lengths were read from, once for every layer


_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("trainplan_attention_layout", default=None)


def current() -> Layout | None:
    return _LAYOUT.get()


def set_layout(layout: Layout | None) -> None:
    """Set for the forward that follows and for its recompute in backward (activation checkpointing calls
    the attention again then): it stays until the next is set."""
    _LAYOUT.set(layout)


@contextlib.contextmanager
def documents(lengths: Sequence[Sequence[int]] | None, exchange: Exchange | None = None) -> Iterator[None]:
    """The documents of the batch about to run (per row, their lengths in order), for this block."""
    token = _LAYOUT.set(Layout(None if lengths is None else tuple(tuple(r) for r in lengths), exchange))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def document_lengths(position_ids: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Each row's document lengths, from position ids that restart at 0 at each document (real values)."""
    rows = []
    s = position_ids.shape[-1]
    for row in position_ids.reshape(-1, s):
        starts = (row == 0).nonzero().view(-1).tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        rows.append(tuple(b - a for a, b in zip(starts, [*starts[1:], s], strict=True)))
    return tuple(rows)


def documents_of(position_ids: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """document_lengths of these (real) position ids, read once a forward: the layout's, where the model's hook
    read them from this very tensor, which every layer is given."""
    layout = _LAYOUT.get()
    if layout is not None and layout.source is not None and layout.source() is position_ids:
        return layout.lengths
    return document_lengths(position_ids)


def _lengths(layout: Layout | None, position_ids, s: int, rows: int):
    """Each row's document lengths: context parallelism's (the whole rows', set as it cut them), else those of the
    position ids the layer was given (real ones), else the trace's (fake ids hold no values), else one a row."""
    from trainplan import _torch_private as P

    if layout is not None and layout.exchange is not None:
        return layout.lengths or ((s,),) * rows
    if position_ids is not None and not P.is_fake(position_ids):
        lengths = documents_of(position_ids)
        return lengths if len(lengths) == rows else lengths * rows  # (1, s) position ids shared by every row
    if layout is not None and layout.lengths is not None:
        return layout.lengths
    if position_ids is not None:  # internal: the trace sets the documents it lays out
        raise AssertionError("packed documents traced without their lengths (run.attention.documents)")
    return ((s,),) * rows


def _causal(q, k, v, dropout: float, scale, gqa: bool) -> torch.Tensor:
    # (b, heads, s, d) -> the output laid out (b, s, heads, d), as transformers' SDPA path returns it
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
    ).transpose(1, 2)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention function: q (b, heads, s, d), k and v (b, kv_heads, s, d); returns the output
    (b, s, heads, d) and no weights. Each document causal in its own call; under context parallelism the
    exchange turns the rank's slice of the sequence into all of it for its share of the heads, and back."""
    if attention_mask is not None:  # internal: no mask function is registered for IMPLEMENTATION
        raise AssertionError(f"{IMPLEMENTATION} was given an attention mask")
    layout = _LAYOUT.get()
    exchange = layout.exchange if layout is not None else None
    if exchange is not None:
        query, key, value = exchange.to_heads(query, key, value)
    b, _, s, _ = query.shape
    lengths = _lengths(layout, kwargs.get("position_ids"), s, b)
    if len(lengths) != b or any(sum(row) != s for row in lengths):  # internal: a layout of another batch
        raise AssertionError(f"documents of {[sum(r) for r in lengths]} tokens for a batch of {b} x {s}")
    window = kwargs.get("sliding_window")
    if window is not None and max(max(r) for r in lengths) > window:
        raise TrainplanError(
            f"memory.attention: a document of {max(max(r) for r in lengths)} tokens is longer than this model's "
            f"sliding window of {window}, which the document-packed attention does not apply; "
            'use data.packing = "none", or documents no longer than the window'
        )
    gqa = key.shape[1] != query.shape[1]
    if all(r == lengths[0] for r in lengths) and len(lengths[0]) == 1:  # one document a row: one call
        out = _causal(query, key, value, dropout, scaling, gqa)
    else:  # one allocation for the whole output, each document's written into its place
        out = None
        for i, row in enumerate(lengths):
            at = 0
            for n in row:
                span = slice(at, at + n)
                part = _causal(
                    query[i : i + 1, :, span], key[i : i + 1, :, span], value[i : i + 1, :, span], dropout, scaling, gqa
                )
                if out is None:
                    out = part.new_empty((b, s, *part.shape[2:]))
                out[i : i + 1, span] = part
                del part
                at += n
    if exchange is not None:
        out = exchange.to_sequence(out)
    return out, None


def _from_the_batch(module, args, kwargs):
    """The model's forward pre-hook: the documents of the batch it is given, from its real position ids (the
    trace's fake ones hold no values: it sets the documents itself)."""
    from trainplan import _torch_private as P

    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        set_layout(Layout())
    elif not P.is_fake(position_ids):
        set_layout(Layout(document_lengths(position_ids), source=weakref.ref(position_ids)))


def install(model) -> None:
    """Read each batch's documents once, as the model (a causal LM, or PEFT's wrapper of one, which calls the
    causal LM's forward directly, past its hooks) is called, for every layer given the same position ids."""
    model.register_forward_pre_hook(_from_the_batch, with_kwargs=True)


def uses(model_config) -> bool:
    return getattr(model_config, "_attn_implementation", None) == IMPLEMENTATION


def register() -> None:
    """Make IMPLEMENTATION a name transformers' attention layers accept (idempotent); no mask is registered,
    so the model's mask code builds none for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
