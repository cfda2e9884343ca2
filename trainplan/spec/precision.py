"""Precision recipes: bytes per element of each kind of tensor.

| recipe   | trainable params | frozen params | compute | grads | optimizer states |
|----------|------------------|---------------|---------|-------|------------------|
| fp32     | fp32             | fp32          | fp32    | fp32  | fp32             |
| amp-bf16 | fp32 (master)    | bf16          | bf16    | fp32  | fp32             |
| amp-fp16 | fp32 (master)    | fp16          | fp16    | fp32  | fp32  + GradScaler |
| bf16     | bf16             | bf16          | bf16    | bf16  | bf16 (torch keeps states in the param dtype) |

Under torch.autocast the fp32 master weights are cast to the compute dtype at each use and
the casts of leaf weights are cached until the autocast region exits (torch/amp/autocast_mode.py,
`cache_enabled`): a second, half-size copy of every trainable weight lives through forward and
backward. Frozen weights (LoRA base, inference) are stored in the compute dtype directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Precision:
    name: str
    param_bytes: int  # trainable parameters as stored
    frozen_bytes: int  # frozen parameters as stored
    compute_bytes: int  # matmul inputs/outputs
    grad_bytes: int
    state_bytes: int  # optimizer states (AdamW m, v; momentum)
    autocast: bool
    needs_bf16: bool
    loss_scaling: bool = False

    @property
    def compute_dtype(self) -> str:
        return {4: "fp32", 2: "fp16" if self.loss_scaling else "bf16"}[self.compute_bytes]


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        name="fp32",
        param_bytes=4,
        frozen_bytes=4,
        compute_bytes=4,
        grad_bytes=4,
        state_bytes=4,
        autocast=False,
        needs_bf16=False,
    ),
    "amp-bf16": Precision(
        name="amp-bf16",
        param_bytes=4,
        frozen_bytes=2,
        compute_bytes=2,
        grad_bytes=4,
        state_bytes=4,
        autocast=True,
        needs_bf16=True,
    ),
    "amp-fp16": Precision(
        name="amp-fp16",
        param_bytes=4,
        frozen_bytes=2,
        compute_bytes=2,
        grad_bytes=4,
        state_bytes=4,
        autocast=True,
        needs_bf16=False,
        loss_scaling=True,
    ),
    "bf16": Precision(
        name="bf16",
        param_bytes=2,
        frozen_bytes=2,
        compute_bytes=2,
        grad_bytes=2,
        state_bytes=2,
        autocast=False,
        needs_bf16=True,
    ),
}
