"""Tensor parallelism in the engine: torch's DTensor tensor-parallel styles (parallelize_module) on each
decoder layer, the embedding, the norms and the head, on the mesh's "tp" axis. Applied to the meta
model before FSDP2 (run/build.py CONVERTERS), so a 2-D run shards the tp shards over "dp"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from trainplan.features import tensor_parallel
from trainplan.run.converter import Build, decoder_layers


def tp_mesh(mesh):
    """The tensor-parallel axis of the run's mesh (run/dist.py `mesh`)."""
    return mesh["tp"] if mesh.ndim > 1 else mesh


def replicated():
    """A module whose parameters are replicated over the tp ranks (a norm): its parameters become
    Replicate DTensors, its input a Replicate DTensor of the (identical) local activation and its
    output the local tensor again. Every parameter of a tp run is then a DTensor on one mesh, which
    gradient clipping's total norm and the optimizer's foreach kernels need (torchtitan's NoParallel)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class Replicated(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def inputs(_, args, mesh):
                return tuple(
                    DTensor.from_local(a, mesh, (Replicate(),), run_check=False) if _plain(a) else a for a in args
                )

            def outputs(_, out, mesh):
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)

    return Replicated()


def _plain(x) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


class _GatherVocab(torch.autograd.Function):
    """The head's logits gathered whole from each tp rank's vocabulary shard (what DTensor's Shard(-1) ->
    Replicate redistribute does: an all-gather into one stacked buffer, then a concatenation along the
    vocabulary), with the shard and the stacked buffer freed the moment the concatenation exists.

    Freed by resizing their storage, not by dropping references: the collective's work object holds
    both and is released by the process group's own thread (gloo's worker, after it reports the
    work done), so a dropped reference frees them at a moment of that thread's choosing. About one
    gather in a hundred, on a busy CPU, kept the shard alive through the loss's log-softmax (+T x V/tp
    bytes on the plan's loss moment, the measured peak 11 % over a plan that was right)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        local = shard.contiguous()
        stacked = local.new_empty((world * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(stacked, local, group=group)
        full = torch.cat(stacked.chunk(world), dim=-1)
        for t in {id(s): s for s in (stacked, local, shard)}.values():
            t.untyped_storage().resize_(0)  # nothing reads them again; see the class's note
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


def gather_vocab(shard: torch.Tensor, group) -> torch.Tensor:
    """Every tp rank's (..., V/tp) logits -> the whole (..., V) on each (_GatherVocab)."""
    return _GatherVocab.apply(shard, group)


class _SumOverTP(torch.autograd.Function):
    """The tp ranks' partial embeddings summed in place (each row is non-zero on the one rank whose
    vocabulary shard holds its token); the gradient passes through unchanged, since everything after
    the embedding is computed alike on every tp rank (Megatron's reduce-from-model-parallel region)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        dist.all_reduce(partial, group=group)
        ctx.mark_dirty(partial)
        return partial

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """Megatron's copy-to-model-parallel region: the replicated input of a split computation passes
    unchanged, and its gradient, one partial sum per tp rank, is summed over them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's own parameters (DTensors) read as this rank's local tensors while its forward runs:
    code that indexes or slices them (a mixture's experts, a router's topk) sees plain tensors; the
    gradient reaches each DTensor through to_local."""
    held = dict(module._parameters)
    try:
        for name, p in held.items():
            if p is not None and hasattr(p, "to_local"):
                module._parameters[name] = p.to_local()
        yield
    finally:
        module._parameters.update(held)


def _local_forward(module: nn.Module, forward, group, split: str | None, *args, **kwargs):
    """`forward` on the module's local parameters. A split module (its parameters tp shards) takes its
    floating inputs through _CopyToTP; a row-wise one ("row": the experts) then sums its ranks' partial
    outputs (_SumOverTP), a column-wise one keeps its share of the output. A replicated one (split None:
    a router) computes alike on every rank."""
    if split:
        args = tuple(_CopyToTP.apply(a, group) if _floating(a) else a for a in args)
    with _local_parameters(module):
        out = forward(module, *args, **kwargs)
    return _SumOverTP.apply(out.contiguous(), group) if split == "row" else out


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def local_style(placements: dict[str, object] | None, split: str | None = None):
    """A module computed on local tensors: each parameter named in `placements` distributed so (the rest
    replicated; None: all replicated), its forward `_local_forward` (split: "row", "column" or None)."""
    import functools

    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class Local(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def partition(_, mod, mesh):
                if mod is not module:
                    return
                for name, p in list(mod.named_parameters(recurse=False)):
                    where = (placements or {}).get(name, Replicate())
                    mod.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [where]), p.requires_grad))

            distribute_module(module, device_mesh, partition_fn=partition)
            forward = type(module).forward
            group = device_mesh.get_group()
            module.forward = functools.partial(_local_forward, module, forward, group, split)
            return module

    return Local()


def experts():
    """A mixture's experts (transformers' 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]): each rank
    holds every expert's share of the intermediate width, the gate's and the up's (a packed split of
    the fused dim, its local [gate_r; up_r] as the experts' chunk(2) reads it), and down by input."""
    from torch.distributed.tensor import Shard

    from trainplan import _torch_private as P

    return local_style({"gate_up_proj": P.packed_shard(1, parts=2), "down_proj": Shard(2)}, "row")


def packed_column(parts: int):
    """A linear whose output is `parts` equal parts fused (Phi-3's [q; k; v] without grouped heads, its
    [gate; up]) split by output within each part: rank r computes [part 0's r-th share; part 1's; ...],
    which the model's own slicing of the output reads as this rank's heads or intermediate width."""
    from trainplan import _torch_private as P

    return local_style({"weight": P.packed_shard(0, parts=parts)}, "column")


def _vocab_parallel_forward(module: nn.Embedding, group, ids: torch.Tensor) -> torch.Tensor:
    """The embedding of `ids` from this rank's vocabulary shard (rows of torch.chunk's split, as the
    Shard(0) DTensor holds them): tokens outside it look up row 0 and are zeroed, then the ranks' rows
    are summed (and scaled where the module scales them: Gemma's `embed_scale`, a replicated buffer).
    Its backward forms the gradient of the shard alone, where DTensor's own embedding
    backward forms the whole vocabulary's (a V x hidden Replicate gradient on every rank, alive
    until the optimizer step: measured +9 % of the step on the tiny Llama, untied)."""
    weight = module.weight
    local = weight.to_local()
    start = dist.get_rank(group) * -(-weight.shape[0] // dist.get_world_size(group))
    outside = (ids < start) | (ids >= start + local.shape[0])
    pad = module.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + local.shape[0] else None
    rows = nn.functional.embedding((ids - start).masked_fill(outside, 0), local, pad)
    summed = _SumOverTP.apply(rows.masked_fill(outside.unsqueeze(-1), 0), group)
    scale = getattr(module, "embed_scale", None)  # Gemma's scaled embedding (x sqrt(hidden)), as its forward
    if scale is None:
        return summed
    return summed * (scale.to_local() if hasattr(scale, "to_local") else scale).to(local.dtype)


def vocab_parallel():
    """The embedding split by vocabulary (Megatron's VocabParallelEmbedding): its weight a Shard(0)
    DTensor as RowwiseParallel makes it, its forward `_vocab_parallel_forward`."""
    import functools

    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class VocabParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            if not isinstance(module, nn.Embedding):
                raise TypeError(f"the vocabulary split takes an nn.Embedding, not {type(module).__name__}")

            def shard(name, mod, mesh):
                param = nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)]), mod.weight.requires_grad)
                mod.register_parameter("weight", param)

            distribute_module(module, device_mesh, partition_fn=shard)
            module.forward = functools.partial(_vocab_parallel_forward, module, device_mesh.get_group())
            return module

    return VocabParallel()


def _linear_plan(layer: nn.Module, name: str, column: bool, parts: int = 1) -> dict:
    """The styles of one projection: its own, or under PEFT's LoRA its base layer's and its adapters',
    split to match (the plan's shapes, plan/tensors.py `_lora_shapes`): beside a column-wise base, A
    whole and B split by output (its output adds to the base's shard; packed as the base where the base
    fuses `parts`); beside a row-wise base, A split by input (its partial sums all-reduced) and B whole."""
    import functools

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    split = ColwiseParallel if column else RowwiseParallel
    if parts > 1:
        split = functools.partial(packed_column, parts)
    module = layer.get_submodule(name)
    if not hasattr(module, "base_layer"):
        return {name: split()}
    out = {f"{name}.base_layer": split()}
    for adapter in module.lora_A:
        out[f"{name}.lora_A.{adapter}"] = replicated() if column else RowwiseParallel()
        out[f"{name}.lora_B.{adapter}"] = ColwiseParallel() if column else replicated()
    return out


def _local_heads(attention: nn.Module, tp: int) -> None:
    """Phi-3's attention slices its fused output by the config's head counts: this rank's are 1/tp of them."""
    import copy

    attention.config = copy.copy(attention.config)
    attention.config.num_attention_heads //= tp
    attention.config.num_key_value_heads //= tp
    attention.num_key_value_heads //= tp


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Split `model` (a causal LM of tensor_parallel.MODEL_TYPES, on the meta device, PEFT's LoRA in place
    or not) over `mesh`'s tp axis. Which parameters train is kept (the styles make new parameters)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    trains = {name: p.requires_grad for name, p in model.named_parameters()}
    top = model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    mesh = tp_mesh(mesh)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    for layer in decoder_layers(model):
        plan = {}
        for name in tensor_parallel.COLUMN + tensor_parallel.ROW:
            if _has(layer, name):  # a mixture's layer has no dense MLP; Phi-3's fuses q/k/v and gate/up
                plan |= _linear_plan(layer, name, column=name in tensor_parallel.COLUMN)
        for name, parts in tensor_parallel.PACKED.items():
            if _has(layer, name):
                plan |= _linear_plan(layer, name, column=True, parts=parts)
                if name == "self_attn.qkv_proj":
                    _local_heads(layer.self_attn, mesh.size())
        for name, module in layer.named_modules():
            if name and not isinstance(module, nn.Linear) and list(module.parameters(recurse=False)):
                if name == tensor_parallel.EXPERTS:
                    plan[name] = experts()
                elif name == tensor_parallel.ROUTER:
                    plan[name] = local_style(None)  # the router: whole on every rank, its topk on plain tensors
                else:
                    plan[name] = replicated()  # the norms (Qwen3's per-head q/k norms too)
        parallelize_module(layer, mesh, plan)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    # (a pipeline stage holds the embedding on the first stage only, the norm and the head on the last)
    outer = {"embed_tokens": vocab_parallel(), "norm": replicated()}
    parallelize_module(base, mesh, {name: style for name, style in outer.items() if getattr(base, name) is not None})
    if model.get_output_embeddings() is not None:
        # the head's vocabulary shard, its logits gathered whole for the loss (the plan's "gathered logits")
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
        group = mesh.get_group()
        model.get_output_embeddings().register_forward_hook(lambda _, __, out: gather_vocab(out, group))
    if tied:  # one Shard(0) parameter for both: the embedding's vocabulary split is the head's
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for name, p in top.named_parameters():
        p.requires_grad_(trains.get(name, True))
    return top


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: the tp split where parallel.tp > 1."""
    if b.dims is not None and b.dims.tp > 1:
        return parallelize(model, b.mesh)
    return model


def checkpointable(state: dict) -> dict:
    """`state` (DCP's model or optimizer state, nested) with each packed DTensor (engine.py `experts`) made
    writable and readable by DCP: its local holds one piece of each part, which DCP, seeing one box a
    rank, would write at the wrong offsets (torch refuses the overlap). Each piece is given as its own
    chunk at its place in the whole tensor, so the checkpoint holds the model's own layout and loads
    under any other split, or none."""
    from trainplan import _torch_private as P

    return {
        k: checkpointable(v) if isinstance(v, dict) else _by_parts(v) if P.packed(v) else v for k, v in state.items()
    }


def pieces(packed) -> dict[torch.Size, torch.Tensor]:
    """A packed DTensor's local as {offset in the whole tensor: view of the local}, a piece of each part."""
    from trainplan import _torch_private as P

    dim, parts = P.packed(packed)
    local, whole = packed.to_local(), packed.shape[dim] // parts
    piece = local.shape[dim] // parts
    if piece * packed.device_mesh.size() != whole:
        raise AssertionError(f"a packed split of {whole} over {packed.device_mesh.size()} ranks is uneven")
    at, out = packed.device_mesh.get_local_rank() * piece, {}
    for i in range(parts):
        offset = [0] * packed.ndim
        offset[dim] = i * whole + at
        out[torch.Size(offset)] = local.narrow(dim, i * piece, piece)
    return out


def _by_parts(packed) -> torch.Tensor:
    """A DTensor sharing `packed`'s storage that gives DCP one chunk per part (its _Checkpointable hooks)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    parts = pieces(packed)

    def write_items(fqn, _):
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(o, v.shape),
                    properties=TensorProperties.create_from_tensor(v),
                    size=packed.size(),
                ),
            )
            for o, v in parts.items()
        ]

    alias = packed.detach()
    alias.__create_write_items__ = write_items
    alias.__create_chunk_list__ = lambda: [ChunkStorageMetadata(o, v.shape) for o, v in parts.items()]
    alias.__get_tensor_shard__ = lambda index: parts[index.offset]
    return alias
