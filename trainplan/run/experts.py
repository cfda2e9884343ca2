"""A mixture's experts read from the layout its checkpoints are published in, by transformers' own conversion
rules (`transformers.conversion_mapping`, what `from_pretrained` applies): each expert's projections as tensors
of their own (`mlp.experts.0.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.0.w1.weight`), where
transformers 5's model holds every layer's experts fused and stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]). A rule's renamings (Mixtral's `block_sparse_moe` -> `mlp`) are read back the
other way for the file's names. Each rank's part is copied from the memory-mapped file straight into the
model's storage, piece by piece: a plain tensor whole, an FSDP2 shard its box of experts, a tp split its share
of each part (packed)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from trainplan import _torch_private as P


class Merge(NamedTuple):
    """One of transformers' expert converters: the per-expert sources (`*` the expert's index) stacked on a new
    dim 0 and, for several sources, concatenated along dim 1 in their order, into the model's `target`."""

    sources: tuple[str, ...]
    target: str


@functools.cache
def rules(model_type: str) -> tuple[tuple[Merge, ...], tuple[tuple[str, str], ...]]:
    """(the expert merges, the renamings as (file's, model's)) transformers registers for `model_type`; only the
    shapes this loader reads: MergeModulelist(dim=0), then Concatenate(dim=1) where there are several sources."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    merges, renames = [], []
    for rule in get_checkpoint_conversion_mapping(model_type) or ():
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(rule, "operations", ())]
        src, tgt = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule).__name__ == "WeightRenaming" and len(src) == len(tgt) == 1 and "*" not in src[0]:
            renames.append((src[0], tgt[0]))
        elif (
            len(tgt) == 1
            and all("*" in p for p in src)
            and ops
            in (
                [("MergeModulelist", 0)],
                [("MergeModulelist", 0), ("Concatenate", 1)],
            )
        ):
            merges.append(Merge(sources=tuple(src), target=tgt[0]))
    return tuple(merges), tuple(renames)


def _as_filed(name: str, renames, where: dict) -> str:
    """The file's name for the model's `name`: as it is, or with a renaming read back (the first that is there)."""
    if name in where:
        return name
    for file_part, model_part in renames:
        old = name.replace(model_part, file_part)
        if old != name and old in where:
            return old
    for file_part, model_part in renames:  # none there: the published form, for the message
        if model_part in name:
            return name.replace(model_part, file_part)
    return name


def sources(name: str, model_type: str, where: dict) -> list[str]:
    """The file's tensors that make the model's `name`: a renamed tensor (Mixtral's router), or the first expert's
    tensors of a merge (the expert count is the model's: `load` reads every one); [] for a name with neither."""
    merges, renames = rules(model_type)
    for m in merges:
        if name.endswith(m.target):
            prefix = name[: len(name) - len(m.target)]
            return [_as_filed(prefix + src.replace("*", "0"), renames, where) for src in m.sources]
    filed = _as_filed(name, renames, where)
    return [filed] if filed != name else []


def load(name: str, tensor: torch.Tensor, where: dict, model_type: str) -> None:
    """Copy `name`'s experts (or a renamed tensor) from the per-expert files `where` maps into `tensor`."""
    merges, renames = rules(model_type)

    def read(key: str) -> torch.Tensor:  # a view of the mapped bytes: nothing allocated
        if key not in where:
            raise KeyError(key)
        with P.untracked():
            return where[key].tensor(key)

    merge = next((m for m in merges if name.endswith(m.target)), None)
    for box, view in local_pieces(tensor):
        if merge is None:  # renamed, not merged
            view.copy_(read(_as_filed(name, renames, where))[box])
            continue
        prefix = name[: len(name) - len(merge.target)]
        for j, e in enumerate(range(*box[0].indices(tensor.shape[0]))):
            parts = [_as_filed(prefix + src.replace("*", str(e)), renames, where) for src in merge.sources]
            if len(parts) == 1:
                view[j].copy_(read(parts[0])[box[1:]])
                continue
            rows, lo = range(*box[1].indices(tensor.shape[1])), 0
            for part in parts:  # the concatenated dim 1 is the parts' rows in order ([gate; up])
                whole = read(part)
                a, b = max(rows.start, lo), min(rows.stop, lo + whole.shape[0])
                if a < b:
                    view[j, a - rows.start : b - rows.start].copy_(whole[a - lo : b - lo, box[2]])
                lo += whole.shape[0]


def local_pieces(tensor: torch.Tensor) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
    """This rank's pieces of `tensor` as (its box of the whole, the local view): a plain tensor whole, an
    FSDP2 or tp shard its box, a packed split one piece of each part."""
    from torch.distributed.tensor import DTensor

    from trainplan.features.tensor_parallel.engine import pieces

    if not isinstance(tensor, DTensor):
        return [(tuple(slice(0, n) for n in tensor.shape), tensor)]
    if P.packed(tensor):
        return [
            (tuple(slice(o, o + n) for o, n in zip(at, v.shape, strict=True)), v) for at, v in pieces(tensor).items()
        ]
    box = P.local_slice(tensor)
    if box is None:
        raise AssertionError(f"no box of the whole for {tensor.placements}")
    return [(box, tensor.to_local())]
