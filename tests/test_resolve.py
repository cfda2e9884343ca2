"""require_runnable: the one rule of what `trainplan train` runs, shared with `advise`."""

import pytest

from trainplan import config as C
from trainplan.resolve import NotRunnable, require_runnable, resolve


def job(**settings):
    cfg = C.load(None, [], {"model.source": "Llama-3.1-8B", **settings})
    return cfg, resolve(cfg).dims


@pytest.mark.parametrize(
    ("settings", "cuda", "field", "what"),
    [
        ({"parallel.tp": 2, "hardware.gpus": "2xH100-80GB"}, True, "parallel.tp", "tensor/pipeline parallelism"),
        ({"parallel.pp": 2, "hardware.gpus": "2xH100-80GB"}, True, "parallel.tp", "tensor/pipeline parallelism"),
        ({"parallel.strategy": "zero2", "hardware.gpus": "2xH100-80GB"}, True, "parallel.strategy", "ZeRO-2"),
        ({"optim.name": "adamw-8bit", "hardware.gpus": "H100-80GB"}, True, "optim.name", "8-bit AdamW (bitsandbytes)"),
        ({"mode": "qlora", "hardware.gpus": "H100-80GB"}, False, "run.mode", "QLoRA without CUDA"),
        (
            {"mode": "qlora", "parallel.strategy": "zero3", "hardware.gpus": "2xH100-80GB"},
            True,
            "run.mode",
            "sharded QLoRA",
        ),
    ],
)
def test_what_the_engine_does_not_run_is_refused_in_one_line(settings, cuda, field, what):
    cfg, dims = job(**settings)
    with pytest.raises(NotRunnable) as e:
        require_runnable(cfg, dims, cuda=cuda)
    assert e.value.field == field and e.value.what == what
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{field}: ")


def test_what_the_engine_runs_passes():
    for settings in (
        {"mode": "qlora", "hardware.gpus": "RTX4090"},  # QLoRA on CUDA
        {"parallel.strategy": "zero2", "hardware.gpus": "H100-80GB"},  # one device: no ZeRO-2 at all
        {"parallel.strategy": "zero3", "mode": "lora", "hardware.gpus": "4xH100-80GB"},
        {"optim.name": "adamw-8bit", "mode": "inference", "hardware.gpus": "H100-80GB"},  # no optimizer
    ):
        cfg, dims = job(**settings)
        require_runnable(cfg, dims, max_positions=131072, cuda=True)


def test_a_sequence_beyond_the_model_context_is_refused():
    cfg, dims = job(**{"batch.seq_len": 4096, "hardware.gpus": "H100-80GB"})
    with pytest.raises(NotRunnable, match="batch.seq_len: 4096 exceeds the model's context of 2048"):
        require_runnable(cfg, dims, max_positions=2048, cuda=True)
