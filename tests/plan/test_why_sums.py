"""Every row's why adds up (issue 46, item 6): at each device's peak, each component's figure is the sum
of the terms its why line names, and a term the line leaves unnamed is exactly the one its note
explains (the bytes the note was written for, `DeviceLedger.noted`).

The set of plans: every case of the plan snapshots (the shipped examples, bench/trace_accuracy.py's
matrix, each strategy, precision and optimizer that branches the ledger), and the features that reshape
a step: the optimizer step in backward, activation offload, checkpointing, compile, the unfused loss,
and an 8B DDP job whose peak is in backward (the row that showed 31.87 GiB of gradients against a note
that said 29.92).
"""

from __future__ import annotations

import pytest
from test_plan_snapshots import cases  # tests/plan, on the path under pytest's default import mode

from trainplan import config as C
from trainplan.errors import TrainplanError
from trainplan.plan.analytic import plan
from trainplan.plan.ledger import GiB, render_table

_8B = {"model.source": "Llama-3.1-8B", "batch.seq_len": 2048, "batch.micro_batch_size": 2}
FEATURES = {
    "ddp-8b-backward-peak": {**_8B, "parallel.strategy": "ddp", "hardware.gpus": "2xH100-80GB"},
    "ddp-8b-accum": {**_8B, "parallel.strategy": "ddp", "batch.grad_accum_steps": 4, "hardware.gpus": "2xH100-80GB"},
    "step-in-backward": {**_8B, "optim.step_in_backward": True, "hardware.gpus": "H100-80GB"},
    "step-in-backward-ac": {
        **_8B,
        "optim.step_in_backward": True,
        "memory.activation_checkpointing": True,
        "hardware.gpus": "H100-80GB",
    },
    "offload-activations": {**_8B, "memory.offload_activations": True, "hardware.gpus": "H100-80GB"},
    "offload-activations-pinned-lora": {
        **_8B,
        "mode": "lora",
        "memory.offload_activations": "pinned",
        "hardware.gpus": "H100-80GB",
    },
    "selective-ac": {**_8B, "memory.activation_checkpointing": "selective", "hardware.gpus": "H100-80GB"},
    "partial-ac": {**_8B, "memory.activation_checkpointing": 8, "hardware.gpus": "H100-80GB"},
    "compile": {**_8B, "train.compile": True, "hardware.gpus": "H100-80GB"},
    "unfused-loss": {**_8B, "train.fused_loss": False, "hardware.gpus": "H100-80GB"},
    "fsdp2-offload": {
        **_8B,
        "parallel.strategy": "zero3",
        "parallel.offload_optimizer": True,
        "hardware.gpus": "4xH100-80GB",
    },
    "qlora": {**_8B, "mode": "qlora", "hardware.gpus": "RTX4090"},
    "qlora-cpu": {"model.source": "tiny-llama", "mode": "qlora", "hardware.gpus": "1x24GiB"},
    "inference": {**_8B, "mode": "inference", "hardware.gpus": "H100-80GB"},
    "cpu-fp32": {"model.source": "tiny-llama", "precision": "fp32", "hardware.gpus": "2x24GiB"},
    "cpu-zero3": {
        "model.source": "tiny-llama",
        "precision": "fp32",
        "parallel.strategy": "zero3",
        "hardware.gpus": "2x24GiB",
    },
}


def _all_cases() -> dict[str, dict]:
    return cases() | {f"feature:{name}": {"settings": settings} for name, settings in FEATURES.items()}


def _plan(case: dict):
    try:
        return plan(C.load(case.get("config"), [], case["settings"]))
    except TrainplanError:  # a refusal has no rows (the snapshots pin it)
        return None


def unexplained(ledger) -> list[str]:
    """Each row of every device whose why does not add up, in words."""
    out = []
    for d in ledger.all_ledgers:
        for c, figure in d.components.items():
            if not figure:
                continue
            where = f"{d.label} {c} {figure / GiB:.4f} GiB at {d.peak_phase}"
            if c not in d.explain:
                out.append(f"{where}: no why line")
                continue
            parts = d.why_parts(c)
            if sum(n for _, n in parts) != figure:
                out.append(f"{where}: its terms sum to {sum(n for _, n in parts)}")
            for label, n in parts:
                if label is None and n != d.noted.get(c, figure if c in ("runtime", "allocator_reserve") else None):
                    out.append(f"{where}: a term of {n} B is not the {d.noted.get(c)} B its note explains")
    return out


@pytest.mark.parametrize("name", sorted(_all_cases()))
def test_every_row_s_terms_sum_to_its_figure(name):
    ledger = _plan(_all_cases()[name])
    if ledger is None:
        pytest.skip("refused")
    assert unexplained(ledger) == []


def test_the_ddp_gradient_row_names_the_head_s_gradient():
    """The 8B DDP row: every gradient kept in DDP's buckets, and the head's formed again in backward."""
    ledger = _plan({"settings": FEATURES["ddp-8b-backward-peak"]})
    d = ledger.devices[0]
    assert d.peak_phase == "backward"
    parts = dict(d.why_parts("gradients"))
    assert parts[None] == d.noted["gradients"] == 8_030_261_248 * 4  # 4 B per param, kept in the buckets
    (head,) = (n for label, n in parts.items() if label and "head" in label)
    assert head == 128_256 * 4096 * 4  # lm_head's fp32 gradient
    why = render_table(ledger).split("\nWhy (")[1]
    line = " ".join(why.split())  # unwrapped
    assert f" gradients {d.components['gradients'] / GiB:.2f} GiB: 4 B per trainable param" in line
    (label,) = (label for label in parts if label and "head" in label)
    assert f"; the terms: {parts[None] / GiB:.2f} GiB of these + {head / GiB:.2f} GiB {label}" in line


def test_a_bare_term_that_is_not_the_note_s_is_found():
    """The check fails where a figure is neither the note's term nor named terms: the DDP row's
    gradients as one bare sum, as the ledger had them before."""
    ledger = _plan({"settings": FEATURES["ddp-8b-backward-peak"]})
    d = ledger.devices[0]
    d.phases = {**d.phases, "backward": {**d.phases["backward"], "gradients": int(d.components["gradients"])}}
    d.__dict__.pop("peak_allocated", None)
    assert any("gradients" in line for line in unexplained(ledger))
