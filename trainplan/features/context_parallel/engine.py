"""Context parallelism in the engine: DeepSpeed-Ulysses on the cp ranks of each replica (features/context_parallel).

A forward pre-hook on the causal LM cuts the training micro-batch to this rank's slice of every sequence (ids,
position ids, and the labels shifted by one before the cut, so no target is lost at a slice's edge) and hands
attention (run/attention.py) the documents of the whole sequence and the all-to-all pair; a forward hook sums
the loss over the cp ranks (backward passes each rank its own share's gradient). Evaluation and generation see
whole sequences, but for the chunked head's held-out sums, which are cut and summed as the loss is. Applied after
the other converters' hooks: it reads the batch as the model is called.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainplan.run import attention
from trainplan.run.converter import Build
from trainplan.run.data import IGNORE_INDEX


def _exchange(x: torch.Tensor, scatter: int, gather: int, group) -> torch.Tensor:
    """All-to-all: x's `scatter` dim cut in cp parts, part j sent to rank j; the parts received joined along
    `gather`, in rank order. One send and one receive buffer of x's size; the joined result is a third."""
    cp = dist.get_world_size(group)
    send = x.unflatten(scatter, (cp, x.shape[scatter] // cp)).movedim(scatter, 0).contiguous()  # (cp, ...)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    del send
    return received.movedim(0, gather).flatten(gather, gather + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
        ctx.args = (group, scatter, gather)
        return _exchange(x, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, scatter, gather = ctx.args
        return _exchange(grad, gather, scatter, group), None, None, None


class _SumOverCP(torch.autograd.Function):
    """The loss summed over the cp ranks (each holds its tokens' sum over the step's tokens); backward gives
    each rank the gradient of the total with respect to its own share, which is 1."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, group) -> torch.Tensor:
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class Ulysses:
    """The exchange around attention (run/attention.Exchange): q, k, v (b, heads, s/cp, d) to (b, heads/cp, s, d),
    key/value heads fewer than cp repeated to cp first; the output (b, s, heads/cp, d) back to (b, s/cp, heads, d)."""

    def __init__(self, group, cp: int):
        self.group, self.cp = group, cp

    def to_heads(self, q, k, v):
        if k.shape[1] % self.cp:  # fewer KV heads than ranks: each repeated, heads stay grouped in order
            k = k.repeat_interleave(self.cp // k.shape[1], dim=1)
            v = v.repeat_interleave(self.cp // v.shape[1], dim=1)
        return tuple(_AllToAll.apply(t, self.group, 1, 2) for t in (q, k, v))

    def to_sequence(self, out):
        return _AllToAll.apply(out, self.group, 1, 2)


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, the next token's label (the last none): what the model's loss shifts in."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


class Split:
    """The hooks of one rank: cut the batch going in, sum the loss (or the held-out sums) coming out."""

    def __init__(self, group, cp: int, index: int):
        self.group, self.cp, self.index = group, cp, index
        self.exchange = Ulysses(group, cp)
        self.cut = False

    def before(self, module: nn.Module, args, kwargs):
        from trainplan.run.loss import fused_head

        ids = kwargs.get("input_ids")
        head = fused_head(module)
        evaluating = head is not None and head._eval_labels is not None  # the chunked head's held-out sums
        self.cut = ids is not None and (evaluating or (module.training and torch.is_grad_enabled()))
        positions = kwargs.get("position_ids")
        from trainplan import _torch_private as P

        if positions is not None and not P.is_fake(positions):
            lengths = attention.documents_of(positions)  # read by the attention's own hook already
        else:  # none (every row one document) or fake (the trace has set them)
            current = attention.current()
            lengths = current.lengths if positions is not None and current is not None else None
        if not self.cut:
            attention.set_layout(attention.Layout(lengths))
            return None
        b, s = ids.shape
        n = s // self.cp
        part = slice(self.index * n, (self.index + 1) * n)
        if positions is None:
            positions = torch.arange(s, device=ids.device).expand(b, s)
        kwargs.update(input_ids=ids[:, part], position_ids=positions[:, part], use_cache=False)
        labels = kwargs.get("labels")
        if labels is not None:
            kwargs.update(labels=labels[:, part], shift_labels=shift(labels)[:, part].contiguous())
        if evaluating:
            head._eval_labels, head._eval_shifted = shift(head._eval_labels)[:, part].contiguous(), True
        if head is not None and head._pending is not None:
            targets, num_items = head._pending[:2]
            head._pending = (shift(targets)[:, part].contiguous(), num_items, True)
        attention.set_layout(attention.Layout(lengths, self.exchange))
        return args, kwargs

    def after(self, module: nn.Module, args, kwargs, output):
        if not self.cut:
            return output
        if getattr(output, "loss", None) is not None:
            output.loss = _SumOverCP.apply(output.loss, self.group)
        elif output.logits.dim() <= 1:  # the fused head's loss, or its held-out sums
            output.logits = _SumOverCP.apply(output.logits, self.group)
        return output


def groups(dims, rank: int):
    """This rank's cp group: the cp consecutive ranks of its replica (every rank creates every group)."""
    cp = dims.cp
    mine, _ = dist.new_subgroups_by_enumeration([list(range(g, g + cp)) for g in range(0, dims.world_size, cp)])
    return mine


def apply(model: nn.Module, b: Build) -> nn.Module:
    if b.dims is None or b.dims.cp == 1:
        return model
    rank = dist.get_rank()
    split = Split(groups(b.dims, rank), b.dims.cp, b.dims.cp_index(rank))
    # on the outermost model: PEFT's wrapper calls the causal LM's forward directly, past its hooks
    model.register_forward_pre_hook(split.before, with_kwargs=True)
    model.register_forward_hook(split.after, with_kwargs=True)
    model._context_parallel = split
    return model
