"""require_runnable: the one rule of what `trainplan train` runs, shared with `advise`."""

import pytest

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.resolve import NotRunnable, require_runnable, resolve


def job(**settings):
    cfg = C.load(None, [], {"model.source": "Llama-3.1-8B", **settings})
    return cfg, resolve(cfg).dims


@pytest.mark.parametrize(
    ("settings", "cuda", "field", "what"),
    [
        (
            {"parallel.tp": 2, "mode": "qlora", "hardware.gpus": "2xH100-80GB"},
            True,
            "parallel.tp",
            "QLoRA under tensor parallelism",
        ),
        (
            {"parallel.tp": 2, "mode": "full", "parallel.strategy": "ddp", "hardware.gpus": "4xH100-80GB"},
            True,
            "parallel.strategy",
            "ddp with tensor parallelism",
        ),
        (
            {"parallel.tp": 2, "mode": "full", "optim.name": "adamw-8bit", "hardware.gpus": "2xH100-80GB"},
            True,
            "optim.name",
            "8-bit AdamW with tensor parallelism",
        ),
        (
            {"parallel.tp": 2, "mode": "full", "train.compile": True, "hardware.gpus": "2xH100-80GB"},
            True,
            "train.compile",
            "torch.compile with tensor parallelism",
        ),
        (
            {"parallel.pp": 2, "hardware.gpus": "2xH100-80GB"},
            True,
            "batch.grad_accum_steps",
            "a pipeline with fewer micro-batches than stages",
        ),
        (
            {
                "parallel.pp": 2,
                "batch.grad_accum_steps": 2,
                "parallel.strategy": "zero1",
                "hardware.gpus": "4xH100-80GB",
            },
            True,
            "parallel.pp",
            "pipeline parallelism with ZeRO-1",
        ),
        (
            {
                "parallel.pp": 2,
                "batch.grad_accum_steps": 2,
                "parallel.strategy": "zero3",
                "hardware.gpus": "2xH100-80GB",
            },
            True,
            "parallel.strategy",
            "FSDP2 over one replica of pipeline stages",
        ),
        (
            {"parallel.pp": 2, "mode": "inference", "hardware.gpus": "2xH100-80GB"},
            True,
            "parallel.pp",
            "inference through pipeline stages",
        ),
        (
            {"parallel.pp": 2, "batch.grad_accum_steps": 2, "train.compile": True, "hardware.gpus": "2xH100-80GB"},
            True,
            "train.compile",
            "torch.compile with pipeline parallelism",
        ),
        ({"parallel.strategy": "zero2", "hardware.gpus": "2xH100-80GB"}, True, "parallel.strategy", "ZeRO-2"),
        (
            {"optim.name": "adamw-8bit", "parallel.strategy": "zero3", "hardware.gpus": "2xH100-80GB"},
            True,
            "parallel.strategy",
            "sharded 8-bit AdamW",
        ),
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


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_a_partitioning_strategy_on_one_data_parallel_rank_is_refused_as_doing_nothing(strategy):
    """At data-parallel degree 1 ZeRO-1/2 would run as a single process, and the record would still name
    it: refused, with the fix, before anything plans."""
    with pytest.raises(ConfigError) as e:
        job(**{"parallel.strategy": strategy, "hardware.gpus": "H100-80GB"})
    assert e.value.field == "parallel.strategy" and "single process" in str(e.value)
    assert "\n" not in str(e.value)
    cfg, dims = job(**{"parallel.strategy": "ddp", "hardware.gpus": "H100-80GB"})  # the default: irrelevant
    assert dims.strategy == "single"


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("strategy", ["zero3", "fsdp-grad-op"])
def test_fsdp2_on_one_device_is_planned_as_it_runs(strategy, offload):
    """zero3 on one process runs FSDP2 over a one-rank mesh (run/setup.py), so it is planned as such."""
    cfg, dims = job(
        **{"parallel.strategy": strategy, "parallel.offload_optimizer": offload, "hardware.gpus": "H100-80GB"}
    )
    assert dims.strategy == strategy and dims.dp == 1 and dims.shards_params


def test_what_the_engine_runs_passes():
    for settings in (
        {"mode": "qlora", "hardware.gpus": "RTX4090"},  # QLoRA on CUDA
        {"parallel.strategy": "zero3", "mode": "lora", "hardware.gpus": "4xH100-80GB"},
        {"optim.name": "adamw-8bit", "mode": "inference", "hardware.gpus": "H100-80GB"},  # no optimizer
        {"optim.name": "adamw-8bit", "hardware.gpus": "H100-80GB"},  # bitsandbytes' AdamW8bit
        {"optim.name": "adamw-8bit", "parallel.strategy": "ddp", "hardware.gpus": "2xH100-80GB"},
        {"parallel.tp": 2, "mode": "full", "hardware.gpus": "2xH100-80GB"},  # the tp split alone
        {"parallel.tp": 2, "mode": "lora", "hardware.gpus": "2xH100-80GB"},  # the adapters split with their base
        {"parallel.tp": 2, "mode": "full", "parallel.strategy": "zero3", "hardware.gpus": "4xH100-80GB"},  # 2-D
    ):
        cfg, dims = job(**settings)
        require_runnable(cfg, dims, max_positions=131072, cuda=True, model_type="llama")


def test_tensor_parallelism_on_an_architecture_the_engine_does_not_split_is_refused():
    cfg, dims = job(**{"parallel.tp": 2, "mode": "full", "hardware.gpus": "2xH100-80GB"})
    with pytest.raises(NotRunnable, match="parallel.tp: the engine splits .* this one is 'gpt2'"):
        require_runnable(cfg, dims, cuda=True, model_type="gpt2")


@pytest.mark.parametrize(("model_type", "what"), [("mixtral", "a mixture's"), ("phi3", "Phi-3's fused")])
def test_a_packed_split_runs_tp_alone_and_refuses_fsdp2_over_it_or_phi3s_grouped_heads(model_type, what):
    cfg, dims = job(**{"parallel.tp": 2, "mode": "full", "hardware.gpus": "2xH100-80GB"})
    require_runnable(cfg, dims, cuda=True, model_type=model_type)
    with pytest.raises(NotRunnable, match=r"parallel.tp: Phi-3's fused qkv_proj under grouped-query attention"):
        require_runnable(cfg, dims, cuda=True, model_type="phi3", grouped_kv=True)
    cfg, dims = job(**{"parallel.tp": 2, "parallel.strategy": "zero3", "mode": "full", "hardware.gpus": "4xH100-80GB"})
    with pytest.raises(NotRunnable, match=f"parallel.tp: FSDP2 over a packed tp split of {what}"):
        require_runnable(cfg, dims, cuda=True, model_type=model_type)


def test_a_sequence_beyond_the_model_context_is_refused():
    cfg, dims = job(**{"batch.seq_len": 4096, "hardware.gpus": "H100-80GB"})
    with pytest.raises(NotRunnable, match="batch.seq_len: 4096 exceeds the model's context of 2048"):
        require_runnable(cfg, dims, max_positions=2048, cuda=True)


@pytest.mark.parametrize(
    ("model", "targets", "modules"),
    [
        ("Llama-3.1-8B", None, ["q_proj", "v_proj"]),  # the one default, "attention"
        ("GPT-2", None, ["c_attn"]),  # fused qkv
        ("Phi-3-mini-4k", None, ["qkv_proj"]),
        ("Qwen3-0.6B", ["all-linear"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("GPT-2", ["all-linear"], ["c_attn", "c_proj", "c_fc"]),
        ("Llama-3.1-8B", ["o_proj", "attention"], ["o_proj", "q_proj", "v_proj"]),
    ],
)
def test_lora_target_sets_resolve_per_architecture(model, targets, modules):
    settings = {"model.source": model, "mode": "lora"} | ({"lora.target_modules": targets} if targets else {})
    r = resolve(C.load(None, [], settings))
    assert sorted(r.cfg.lora.target_modules) == sorted(modules)


def test_plan_train_and_accept_share_one_lora_default():
    """accept's default configuration sets no targets of its own: plan, train, advise and accept
    all start from LoraConfig's."""
    from trainplan.verify.accept import DEFAULT_CONFIG

    assert "target_modules" not in DEFAULT_CONFIG.read_text()
    assert C.load(DEFAULT_CONFIG, []).lora.target_modules == C.LoraConfig().target_modules == ["attention"]


@pytest.mark.parametrize(
    "gpus, expected",
    [
        ("cpu", "fp32"),  # whatever the CPU's flags: a CPU plan does not depend on the machine
        ("2xH100-80GB", "amp-bf16"),
        ("V100-32GB", "amp-fp16"),  # no bf16: fp16 with loss scaling, not a refusal
        ("H100-80GB,V100-32GB", "amp-fp16"),  # one device without bf16 decides for all
        ("24GiB", "amp-bf16"),
    ],
)
def test_precision_auto_is_mixed_where_the_gpus_have_it_and_fp32_on_the_cpu(gpus, expected):
    r = resolve(C.load(None, [f"hardware.gpus='{gpus}'"]))
    assert C.RunConfig().precision == "auto"
    assert r.cfg.precision == expected and r.precision.name == expected


def test_an_explicit_bf16_on_a_gpu_without_it_is_still_refused():
    with pytest.raises(ConfigError, match="run.precision: amp-bf16 needs bf16, which V100-32GB lacks"):
        resolve(C.load(None, ["hardware.gpus='V100-32GB'", "precision='amp-bf16'"]))
