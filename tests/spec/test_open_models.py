"""The open models of 2026 through the planner (issue 69, first step): latent attention (DeepSeek-V3's MLA, a value
head narrower than the query's), attention sinks (gpt-oss, whose model class has no SDPA), hybrid layers (Bamba's
Mamba layers, no attention projection), configs transformers refuses to build, and per-layer settings that no
shallow copy can keep (Gemma-4). Each plans, or is refused in one line naming the part: never an internal error.
Tiny configs from transformers' own config classes; bench/model_sweep.py walks every model_type at full size."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.test_bad_input import _check
from trainplan import cli


def _config(tmp_path, model_type: str, **fields) -> str:
    config = transformers.CONFIG_MAPPING[model_type](**fields).to_dict()
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({**config, "model_type": model_type}))
    return str(path)


TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512}
DEEPSEEK_V3 = {
    **TINY,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,  # narrower than the query's 24: flash attention cannot run it
}
GPT_OSS = {
    **TINY,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"],
}


def test_latent_attention_runs_memory_efficient_attention_in_the_cuda_trace():
    """CUDA dispatches q/k/v of different head widths to memory-efficient attention; flash's meta kernel would
    hand back the query's width, which the output projection of a latent attention cannot take."""
    from trainplan import _torch_private as P

    q, k = torch.randn(1, 4, 8, 24, dtype=torch.bfloat16), torch.randn(1, 4, 8, 24, dtype=torch.bfloat16)
    v = torch.randn(1, 4, 8, 8, dtype=torch.bfloat16)
    with P.fake_mode():
        fq, fk, fv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
        with P.cuda_kernels():
            out = torch.nn.functional.scaled_dot_product_attention(fq, fk, fv, is_causal=True)
    assert out.shape == (1, 4, 8, 8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_deepseek_v3s_latent_attention_and_experts_plan_and_meet_their_trace(mode, tmp_path, capsys):
    from trainplan import config as C
    from trainplan.plan import analytic, traced

    path = _config(tmp_path, "deepseek_v3", **DEEPSEEK_V3)
    assert cli.main(["plan", "--model", path, "--mode", mode, "--gpus", "H100-80GB", "--seq", "128", "--json"]) in (
        0,
        1,
    )
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "deepseek_v3"
    cfg = C.load(None, [f"model.source={path}", f"mode={mode}", "hardware.gpus=H100-80GB", "batch.seq_len=128"])
    result, r = traced.trace(cfg)
    planned = analytic.plan(r.cfg, r.spec).devices[0].peak_allocated
    assert abs(planned / result.peak_bytes - 1) < 0.05, (planned, result.peak_bytes)


def test_gpt_oss_runs_eager_attention_as_its_model_class_declares_and_refuses_sdpa_by_name(
    tmp_path, capsys, monkeypatch
):
    from trainplan import config as C
    from trainplan.resolve import resolve

    path = _config(tmp_path, "gpt_oss", **GPT_OSS)
    r = resolve(C.load(None, [f"model.source={path}", "mode=lora", "hardware.gpus=H100-80GB", "batch.seq_len=64"]))
    assert r.spec.attention("auto") == "eager"
    assert cli.main(["plan", "--model", path, "--mode", "lora", "--gpus", "H100-80GB", "--seq", "64", "--json"]) in (
        0,
        1,
    )
    capsys.readouterr()
    _check(
        ["plan", "--model", path, "--gpus", "H100-80GB", "--seq", "64", "--set", 'memory.attention="sdpa"'],
        r"^memory\.attention: transformers has no SDPA path for gpt_oss",
        tmp_path,
        capsys,
        monkeypatch,
    )


def test_what_transformers_refuses_to_build_is_the_configs_fault_in_its_own_words(tmp_path, capsys, monkeypatch):
    """dots1's default config (as transformers 5 ships it) does not build: model.source, with transformers' reason."""
    path = _config(tmp_path, "dots1")
    _check(
        ["plan", "--model", path, "--gpus", "H100-80GB"],
        r"^model\.source: transformers [\d.]+ cannot build a dots1 model from this config \(TypeError: ",
        tmp_path,
        capsys,
        monkeypatch,
    )


def test_lora_on_a_hybrid_whose_first_layer_has_no_attention_names_what_it_has(tmp_path, capsys, monkeypatch):
    """Jamba's first layer is a Mamba layer: LoRA's default 'attention' set names nothing there, and the refusal
    says what the layer has. Full fine-tuning, which places no adapters, plans (its trace builds no adapters)."""
    hybrid = {"num_key_value_heads": 2, "intermediate_size": 128, "num_experts": 2, "expert_layer_period": 2}
    hybrid |= {"expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8}
    path = _config(tmp_path, "jamba", **TINY, **hybrid, mamba_dt_rank=8)
    assert cli.main(["plan", "--model", path, "--mode", "full", "--gpus", "H100-80GB", "--seq", "64", "--json"]) in (
        0,
        1,
    )
    capsys.readouterr()
    _check(
        ["plan", "--model", path, "--mode", "lora", "--gpus", "H100-80GB", "--seq", "64"],
        r"^lora\.target_modules: 'attention' names no linear layer of jamba: its first decoder layer has no attention "
        r"projection .*, only .*in_proj",
        tmp_path,
        capsys,
        monkeypatch,
    )


def test_per_layer_settings_no_shallow_copy_can_keep_are_refused_by_name(tmp_path, capsys, monkeypatch):
    """Gemma-4's per_layer_config names layers deeper than the 1- and 2-layer copies the terms are derived from."""
    path = _config(tmp_path, "gemma4_text")
    _check(
        ["plan", "--model", path, "--mode", "full", "--gpus", "H100-80GB", "--seq", "64"],
        r"^model\.source: gemma4_text has no hand-written terms, and its terms cannot be derived: transformers refuses",
        tmp_path,
        capsys,
        monkeypatch,
    )


def test_a_forward_that_fails_on_its_own_config_is_refused_where_transformers_fails(tmp_path, capsys, monkeypatch):
    """DeepSeek-V2's config class leaves num_experts_per_tok None by default; its router's topk then fails inside
    transformers' forward: a refusal naming the file and line, not an internal error."""
    fields = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("n_group", "topk_group")}
    path = _config(tmp_path, "deepseek_v2", **{**fields, "num_experts_per_tok": None})
    _check(
        ["plan", "--model", path, "--mode", "full", "--gpus", "H100-80GB", "--seq", "64"],
        r"^model\.source: deepseek_v2 has no hand-written terms, and its own forward fails on this config in a "
        r"[12]-layer copy, at modeling_deepseek_v2\.py:\d+ in forward \(TypeError: topk\(\)",
        tmp_path,
        capsys,
        monkeypatch,
    )


def test_a_forward_that_reads_tensor_values_cannot_be_traced_and_says_so(tmp_path, capsys, monkeypatch):
    """JetMoE's router turns a tensor into a Python list; a trace on fake tensors has no values to give it."""
    fields = {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 4}
    path = _config(tmp_path, "jetmoe", **TINY, **fields)
    _check(
        ["plan", "--model", path, "--mode", "full", "--gpus", "H100-80GB", "--seq", "64"],
        r"^model\.source: jetmoe has no hand-written terms, and its own forward fails .* at modeling_jetmoe\.py:\d+ "
        r"in forward \(it reads tensor values .*\); this architecture is not planned yet$",
        tmp_path,
        capsys,
        monkeypatch,
    )


# the 2026 flagships' presets: their parameter totals as their model cards state them (billions)
PUBLISHED_TOTALS = {
    "openai/gpt-oss-20b": 21,
    "openai/gpt-oss-120b": 117,
    "Qwen/Qwen3-30B-A3B": 30.5,
    "Qwen/Qwen3-235B-A22B": 235,
    "zai-org/GLM-4.5-Air": 106,
    "deepseek-ai/DeepSeek-V3": 671,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_the_2026_presets_hold_their_published_parameter_totals(name, tmp_path):
    """The presets are transcribed from the published config.json files without network; each spec's parameter
    count (from transformers' own module on the meta device, tests/spec/test_model.py) lands on the total its
    model card states, to the card's rounding."""
    from trainplan.spec import layout
    from trainplan.spec import model as M

    assert M.find_preset(name) == name
    spec = layout.with_layout(M.load_model_spec(name), str(tmp_path))  # the module's own parameters, as planned
    assert spec.num_params / 1e9 == pytest.approx(PUBLISHED_TOTALS[name], rel=0.02)
