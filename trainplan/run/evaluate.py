"""The held-out metric: mean token cross-entropy, perplexity and token accuracy.

Where the chunked loss head is installed (run/loss.py), the metric is computed through it a chunk
of tokens at a time, so evaluation never holds the (tokens x vocab) logits that training avoids.
Evaluation runs under inference_mode in eval mode, forks the RNG and restores train mode, so
it cannot disturb the training run: losses with and without periodic evaluation are identical.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainplan.run.data import IGNORE_INDEX
from trainplan.run.loss import fused_head, model_inputs
from trainplan.run.step import autocast
from trainplan.spec.precision import Precision


def reshard(model: nn.Module) -> None:
    """Return FSDP2 units to their sharded state after a forward without backward. With
    reshard_after_forward=False (ZeRO-2-like) nothing else does, and the next forward would reuse
    the unsharded parameters gathered before the optimizer changed the shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def logit_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(loss sum, correct next-token predictions, target tokens), float64 on the CPU, of fp32 logits
    already shifted (position t predicts t + 1) against `labels`."""
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    ce = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    correct = ((logits.argmax(-1) == target) & mask).sum()
    return torch.stack([ce.double(), correct.double(), mask.sum().double()]).cpu()


def evaluate(
    model: nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    micro_batch: int,
    max_batches: int,
    prec: Precision,
    device: torch.device,
    training_run: bool = True,
    pipeline=None,
) -> dict:
    """The held-out metric over `ids`; on several ranks every rank evaluates every row, so each holds
    the whole metric (summing it over the ranks counted each held-out token once a rank).

    training_run: evaluate under no_grad, not inference_mode: FSDP all-gathers parameters
    during the forward, and inference tensors cannot be updated in place by the next step.
    pipeline: this rank's stage of a pipeline (features/pipeline_parallel/engine.py `Pipeline`), whose
    forward runs through every stage; `model` is then the stage's part of the model."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    n = ids.shape[0] if not max_batches else min(ids.shape[0], max_batches * micro_batch)
    grad_free = torch.no_grad() if training_run else torch.inference_mode()
    head = fused_head(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), grad_free:
        for start in range(0, n, micro_batch):
            width = ids.shape[1] if lengths is None else int(lengths[start : start + micro_batch].max())
            x = ids[start : start + micro_batch, :width].to(device)  # one document a row: to the longest
            y = labels[start : start + micro_batch, :width].to(device)
            batch = {"input_ids": x}
            if positions is not None:  # document packing: each document attends to itself only
                batch["position_ids"] = positions[start : start + micro_batch].to(device)
            if pipeline is not None:
                sums = pipeline.eval_sums(batch, y, prec=prec, device_type=device.type)
            elif head is not None:  # the chunked head: no (tokens x vocab) logits, as in training
                with autocast(prec, device.type), head.eval_targets(y):
                    sums = model(**model_inputs(batch)).logits.cpu()
            else:
                with autocast(prec, device.type):
                    logits = model(**model_inputs(batch)).logits
                logits = logits[:, :-1].float()
                sums = logit_sums(logits, y)
                del logits  # not held through the next batch's forward (the tp head's gather is wider)
            loss_sum, correct, count = loss_sum + sums[0], correct + sums[1], count + sums[2]
    reshard(pipeline.module if pipeline is not None else model)  # a pipeline's stage module holds the model
    model.train(was_training)
    mean = float(loss_sum / count) if count else float("nan")
    return {
        "loss": mean,
        "perplexity": math.exp(mean) if count else float("nan"),
        "token_accuracy": float(correct / count) if count else float("nan"),
        "tokens": int(count),
    }
