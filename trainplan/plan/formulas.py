"""Closed-form figures as the literature states them: the KV cache, the model states per parameter
(Hugging Face's "Anatomy of a model's memory") and ZeRO's model states per GPU (Rajbhandari et al.
2020). The analytic plan bills the KV cache with the first; tests/plan/test_formulas.py holds the plan
to the other two. Imports no torch.
"""

from __future__ import annotations

from trainplan.spec.precision import Precision


def kv_cache_bytes(*, batch: int, context: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for every layer: 2 x batch x context x layers x kv_heads x head_dim x bytes."""
    return 2 * batch * context * layers * kv_heads * head_dim * dtype_bytes


def model_state_bytes_per_param(precision: Precision, optimizer: str = "adamw") -> int:
    """Bytes per trainable parameter held between steps (weights + copy + grads + states).

    amp (fp32 master + autocast copy): 4 + 2 + 4 + 8 = 18, Hugging Face's "Anatomy of a
    model's memory". fp32: 16. Pure bf16: 2 + 2 + 4 = 8.
    """
    states = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}[optimizer] * precision.state_bytes
    copy = precision.compute_bytes if precision.autocast else 0
    return precision.param_bytes + copy + precision.grad_bytes + states


def zero_model_state_bytes(*, params: int, dp: int, stage: int, k: int = 12, low: int = 2) -> int:
    """ZeRO model states per GPU (Rajbhandari et al. 2020, Sec. 5.1 / Fig. 1): 16-bit weights and
    gradients (`low` bytes each), K bytes of fp32 master + Adam states per parameter.

    stage 0: (2 + 2 + K)Ψ; 1: 4Ψ + KΨ/N; 2: 2Ψ + (2 + K)Ψ/N; 3: (4 + K)Ψ/N.
    """
    p = params
    if stage == 0:
        return (2 * low + k) * p
    if stage == 1:
        return 2 * low * p + k * p // dp
    if stage == 2:
        return low * p + (low + k) * p // dp
    if stage == 3:
        return (2 * low + k) * p // dp
    raise ValueError(f"ZeRO stage must be 0-3 (got {stage})")
