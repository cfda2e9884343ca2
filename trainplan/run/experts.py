"""A mixture's experts read from the checkpoint layout Mixtral's weights are published in: the router
under `block_sparse_moe.gate`, and each expert's gate (w1), up (w3) and down (w2) as a tensor of its
own, where transformers 5's model holds every layer's experts fused and stacked (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I], transformers' own conversion on its load). Each rank's
part is copied from the memory-mapped file straight into the model's storage, piece by piece: a plain
tensor whole, an FSDP2 shard its box of experts, a tp split its share of each part (packed)."""

from __future__ import annotations

import torch

from trainplan import _torch_private as P

GATE_UP, DOWN, ROUTER = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj", ".mlp.gate.weight"


def sources(name: str) -> list[str]:
    """The file's tensors that make `name` (a model's state-dict key) in the per-expert layout; [] for
    a key that has none (the expert count is read from the file: `missing` finds the first)."""
    for suffix, parts in ((GATE_UP, ("w1", "w3")), (DOWN, ("w2",))):
        if name.endswith(suffix):
            layer = name.removesuffix(suffix)
            return [f"{layer}.block_sparse_moe.experts.0.{w}.weight" for w in parts]
    if name.endswith(ROUTER):
        return [name.removesuffix(ROUTER) + ".block_sparse_moe.gate.weight"]
    return []


def load(name: str, tensor: torch.Tensor, where: dict) -> None:
    """Copy `name`'s experts (or router) from the per-expert files `where` maps into `tensor`."""

    def read(key: str) -> torch.Tensor:  # a view of the mapped bytes: nothing allocated
        if key not in where:
            raise KeyError(key)
        with P.untracked():
            return where[key].tensor(key)

    for box, view in local_pieces(tensor):
        if name.endswith(ROUTER):
            view.copy_(read(sources(name)[0])[box])
            continue
        layer = name.rsplit(".mlp.", 1)[0] + ".block_sparse_moe.experts"
        for j, e in enumerate(range(*box[0].indices(tensor.shape[0]))):
            if name.endswith(DOWN):
                view[j].copy_(read(f"{layer}.{e}.w2.weight")[box[1:]])
                continue
            inter, rows = tensor.shape[1] // 2, range(*box[1].indices(tensor.shape[1]))
            for w, lo in (("w1", 0), ("w3", inter)):  # the fused dim is [gate; up]
                a, b = max(rows.start, lo), min(rows.stop, lo + inter)
                if a < b:
                    part = read(f"{layer}.{e}.{w}.weight")[a - lo : b - lo, box[2]]
                    view[j, a - rows.start : b - rows.start].copy_(part)


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
