"""QLoRA's frozen base (Dettmers et al. 2023): every linear but the output head stored as
bitsandbytes NF4 with double quantization, computed in the precision's compute dtype; the LoRA
adapters on top train as in `lora` mode.

Tested with bitsandbytes 0.50.2 (the version requirements.txt pins). Runs are CUDA only; the CPU
backend runs the same code for the tests, through `allow_cpu`.

Why quantization waits for materialize: bitsandbytes quantizes real values (a Params4bit packs
itself inside `.to(device)`), and `Module.to_empty` rebuilds every parameter as a plain
`nn.Parameter`, dropping Params4bit and its quant_state. So the meta build swaps the linears for
`bnb.nn.Linear4bit` (PEFT must see them there to wrap them with its 4-bit LoRA layer), `allocate`
gives their weights host memory, and `quantize` packs each one onto the device after it is
initialized or loaded: no more than one linear's 16-bit weight reaches the device at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from trainplan.errors import TrainplanError
from trainplan.features import qlora
from trainplan.run.converter import Build, dtypes
from trainplan.spec.model import ModelSpec

TESTED_BITSANDBYTES = "0.50.2"
# Before 0.43.2 (bitsandbytes #1270, 2024-07), MatMul4Bit kept every 4-bit linear's input for backward
# though the frozen weight needs none: 1.9 GB more than planned for Llama-2 7B at 1,304 tokens
# (docs/memory-model.md, "QLoRA against published measurements"). The plan counts no such input.
FIRST_PLANNED_BITSANDBYTES = (0, 43, 2)
QUANT_TYPE = "nf4"
DENSE = ("lm_head",)  # kept in the frozen dtype, as the analytic plan assumes


def _bnb():
    try:
        import bitsandbytes
    except ImportError:
        raise TrainplanError(
            f"run.mode: qlora needs bitsandbytes (pip install bitsandbytes=={TESTED_BITSANDBYTES})"
        ) from None
    check_version(bitsandbytes.__version__)
    return bitsandbytes


def check_version(version: str) -> None:
    """Refuse a bitsandbytes whose 4-bit matmul keeps its input for backward: the run would hold
    more than the plan says."""
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    if release < FIRST_PLANNED_BITSANDBYTES:
        raise TrainplanError(
            f"run.mode: qlora with bitsandbytes {version}: before 0.43.2 its 4-bit matmul keeps every linear's input "
            f"for backward, which the plan does not count; pip install bitsandbytes=={TESTED_BITSANDBYTES}"
        )


def is_4bit(model: nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "is_loaded_in_4bit", False)


def linears_4bit(model: nn.Module) -> list[nn.Module]:
    bnb = _bnb()
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def swap_linears(
    model: nn.Module, spec: ModelSpec, *, compute_dtype: torch.dtype, frozen_dtype: torch.dtype
) -> nn.Module:
    """On the meta device: every nn.Linear but the output head becomes a bnb Linear4bit (NF4,
    double quantization) whose weight is still unquantized, in the frozen dtype.

    Refuses a model with weights the plan counts in NF4 that are not nn.Linear (GPT-2's Conv1D,
    fused 3-D expert weights): they would stay 16-bit, and the run would not be the plan."""
    bnb = _bnb()
    planned = {t.name.removesuffix(".weight") for t in spec.tensors if t.role in ("linear", "expert")}
    dense = sorted(planned - {name for name, m in model.named_modules() if type(m) is nn.Linear})
    if dense:
        raise TrainplanError(
            f"run.mode: qlora quantizes nn.Linear layers only, and {dense[0]} is not one ({len(dense)} such "
            "weights); use mode = lora for this model"
        )
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.rsplit(".", 1)[-1] in DENSE:
            continue
        with torch.device("meta"):
            linear = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,  # double quantization of the absmax constants
                quant_type=QUANT_TYPE,
            )
        linear.to(frozen_dtype).requires_grad_(False)
        # On CPUs with AVX512-BF16, eval-mode forwards repack the weight in place into another
        # layout; the bytes would then differ from the quantized ones the lora contract compares.
        linear.support_avx512bf16_for_cpu = False
        model.set_submodule(name, linear)
    model.is_loaded_in_4bit = True  # how transformers marks it; PEFT then picks its 4-bit LoRA layer
    return model


def allocate(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`to_empty`, with the 4-bit linears' weights on the host (unquantized) until `quantize`."""
    held = {}
    for linear in linears_4bit(model):
        held[linear] = linear.weight
        del linear.weight
    model.to_empty(device=device)
    for linear, weight in held.items():
        linear.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="cpu"), requires_grad=False)
    return model


def quantize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Pack each 4-bit linear's (initialized or loaded) weight to NF4 on `device`, one at a time."""
    bnb = _bnb()
    for linear in linears_4bit(model):
        linear.weight = bnb.nn.Params4bit(
            linear.weight.data,
            requires_grad=False,
            compress_statistics=True,
            quant_type=QUANT_TYPE,
            quant_storage=torch.uint8,
            module=linear,
        ).to(device)  # Params4bit quantizes here, on the target device
    return model


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The engine's converter: the base's linear layers become bitsandbytes' 4-bit ones (quantized when
    materialized)."""
    if qlora.on(b.cfg):
        dt = dtypes(b.prec)
        swap_linears(model, b.spec, compute_dtype=dt.compute, frozen_dtype=dt.frozen)
    return model
