"""The causal-LM loss without the (tokens x vocab) logits: chunked, fused linear cross-entropy.

transformers' loss materialises the logits, their fp32 upcast, log-softmax's output and, in
backward, three more fp32 (tokens x vocab) buffers. With a 49k-152k vocabulary these are the
largest tensors of a step: on SmolLM2-135M (micro-batch 4 x seq 256) about 1 GB. (The step is
not measurably faster for it on the CPU; the gain is memory. docs/benchmarks.md.)

Here the output head computes the logits `chunk_tokens` rows at a time, forms the loss and the
logits gradient (softmax - one-hot) in place, and multiplies it back through the head weight at
once. The forward returns the loss and keeps only dL/dhidden (tokens x hidden) and, when the
head trains, dL/dW; backward scales them by the incoming gradient. The idea is Liger-Kernel's
FusedLinearCrossEntropy and Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
Models"; numerics are those of log-softmax + NLL (fp32 softmax over compute-dtype logits).

The head is the model's own `nn.Linear` with its class swapped (its parameter, tying and FSDP
sharding are untouched), so the tracer, the planner and the run see the same code.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from trainplan.run.data import IGNORE_INDEX


def _chunk(h, y, w, grad_h, grad_w, compute_dtype) -> torch.Tensor:
    """Loss sum of one chunk; writes its rows of dL/dhidden and adds its share of dL/dW.
    A function of its own so that every chunk-sized buffer is freed before the next chunk."""
    h = h.to(compute_dtype)
    y = y[:, None]  # (chunk, 1)
    logits = (h @ w.t()).float()  # (chunk, vocab), fp32 for the softmax
    valid = (y != IGNORE_INDEX).float()  # a float mask: mixed-dtype CPU ops cast in hidden temporaries
    y = y.clamp(min=0)
    picked = logits.gather(1, y)
    top = logits.amax(1, keepdim=True)
    probs = logits.sub_(top).exp_()  # in place: no second (chunk, vocab) buffer
    sums = probs.sum(1, keepdim=True)
    loss_sum = ((sums.log() + top - picked) * valid).sum()
    if grad_h is None and grad_w is None:
        return loss_sum
    probs.mul_(valid / sums)  # softmax; rows without a target get no gradient
    probs.scatter_add_(1, y, valid.neg())  # minus the one-hot target
    g = probs.to(compute_dtype)
    del probs, logits
    if grad_h is not None:
        if grad_h.dtype == compute_dtype:
            torch.mm(g, w, out=grad_h)
        else:
            grad_h.copy_(g @ w)
    if grad_w is not None:
        grad_w.addmm_(g.t(), h)
    return loss_sum


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, denom, chunk_tokens: int, compute_dtype: torch.dtype):
        # hidden (tokens, hidden) in the residual dtype; weight (vocab, hidden); targets (tokens,)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)  # autocast's copy of the head weight, held by this call only
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros_like(w) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                total += _chunk(
                    hidden[rows], targets[rows], w, None if grad_h is None else grad_h[rows], grad_w, compute_dtype
                )
            del w
        ctx.grads = (grad_h, grad_w, weight.dtype)
        ctx.denom = denom
        return total / denom

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, w_dtype = ctx.grads
        ctx.grads = None
        scale = grad_loss / ctx.denom
        if grad_h is not None:
            grad_h = grad_h.mul_(scale.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(scale.to(grad_w.dtype)).to(w_dtype)
        return grad_h, grad_w, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_items, chunk_tokens: int, *, shifted=False
) -> torch.Tensor:
    """Mean token loss of `hidden @ weight.T` against `labels` shifted by one (unless `shifted`: each position's
    target already), as transformers' ForCausalLMLoss computes it: sum over target tokens / num_items (or / their
    count)."""
    if shifted:
        targets = labels.reshape(-1)
    else:
        targets = torch.full_like(labels, IGNORE_INDEX)  # (batch, seq)
        targets[..., :-1] = labels[..., 1:]
        targets = targets.reshape(-1)
    denom = num_items if num_items is not None else (targets != IGNORE_INDEX).sum()
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets, denom, chunk_tokens, dtype)


@torch.no_grad()
def chunked_eval_sums(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, *, shifted=False
):
    """(loss sum, correct next-token predictions, target tokens) of `hidden @ weight.T` against
    `labels` shifted by one, `chunk_tokens` rows at a time: the held-out metric without the
    (tokens x vocab) logits. Numerics of run/evaluate.py's unfused path: fp32 log-softmax over
    compute-dtype logits, argmax of the same fp32 logits."""
    if shifted:  # each position's target already (context parallelism's cut)
        targets = labels.reshape(-1)
    else:
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[..., :-1] = labels[..., 1:]
        targets = targets.reshape(-1)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    flat = hidden.reshape(-1, hidden.shape[-1])
    sums = torch.zeros(3, dtype=torch.float64, device=hidden.device)
    with torch.autocast(device, enabled=False):
        w = weight.to(dtype)
        for start in range(0, flat.shape[0], chunk_tokens):
            y = targets[start : start + chunk_tokens, None]
            logits = (flat[start : start + chunk_tokens].to(dtype) @ w.t()).float()
            valid = y != IGNORE_INDEX
            right = (logits.argmax(1, keepdim=True) == y) & valid
            y = y.clamp(min=0)
            picked = logits.gather(1, y)
            top = logits.amax(1, keepdim=True)
            lse = logits.sub_(top).exp_().sum(1, keepdim=True).log_() + top  # in place: one chunk buffer
            del logits
            sums[0] += ((lse - picked) * valid).sum().double()
            sums[1] += right.sum()
            sums[2] += valid.sum()
    return sums


class FusedLossHead(nn.Linear):
    """The output head; while `targets` are set it returns the loss instead of the logits, and
    while `eval_targets` are set the held-out sums (loss, correct, count) instead of the logits."""

    chunk_tokens: int = 128
    _pending: tuple | None = None
    _eval_labels: torch.Tensor | None = None
    _eval_shifted: bool = False  # _eval_labels are each position's target (context parallelism's cut)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._eval_labels is not None:
            return chunked_eval_sums(
                hidden, self.weight, self._eval_labels, self.chunk_tokens, shifted=self._eval_shifted
            )
        if self._pending is None:  # generation: ordinary logits
            return super().forward(hidden)
        labels, num_items, *shifted = self._pending  # shifted: labels already each position's target (cp's cut)
        return chunked_cross_entropy(hidden, self.weight, labels, num_items, self.chunk_tokens, shifted=bool(shifted))

    @contextlib.contextmanager
    def eval_targets(self, labels: torch.Tensor):
        self._eval_labels = labels
        try:
            yield
        finally:
            self._eval_labels, self._eval_shifted = None, False

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor, num_items):
        self._pending = (labels, num_items)
        try:
            yield
        finally:
            self._pending = None


def install(model: nn.Module, chunk_tokens: int) -> None:
    """Swap the output head's class; the caller has checked the architecture qualifies
    (trainplan.spec.model.fused_loss_applies)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:  # internal: the predicate is wrong
        raise AssertionError(f"fused loss needs a bias-free nn.Linear head, found {type(head).__name__}")
    head.__class__ = FusedLossHead
    head.chunk_tokens = chunk_tokens


def fused_head(model: nn.Module) -> FusedLossHead | None:
    return next((m for m in model.modules() if isinstance(m, FusedLossHead)), None)


def model_inputs(batch: dict) -> dict:
    """The batch's ids, and its position ids where each packed document has its own: transformers then
    masks attention block-causally (masking_utils.find_packed_sequence_indices), which it does only
    without a KV cache, so none is made."""
    if "position_ids" not in batch:
        return {"input_ids": batch["input_ids"]}
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def causal_lm_loss(model: nn.Module, batch: dict, num_items=None) -> torch.Tensor:
    """The model's mean token loss over `batch`: through the fused head where installed."""
    head = fused_head(model)
    if head is None:
        return model(**model_inputs(batch), labels=batch["labels"], num_items_in_batch=num_items).loss
    with head.targets(batch["labels"], num_items):
        return model(**model_inputs(batch)).logits
