"""Loading weights: streamed from the mapped file into the model, never a second copy beside it."""

import re

import pytest

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.plan import analytic
from trainplan.resolve import resolve
from trainplan.run import weights

torch = pytest.importorskip("torch")


def allocator_peak(fn):
    """Peak bytes the CPU allocator held while fn ran (torch.profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return out, peak


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_loading_the_embedded_default_holds_the_weights_once(mode):
    """Loading read the whole file into memory beside the model: 2.0x the weights. Now the load
    peak is the model itself (tied embeddings allocated once, every tensor copied from the map)."""
    cfg = C.load(None, [f"mode={mode}", "precision=fp32", "hardware.gpus=cpu"])
    r = resolve(cfg)
    weights.weights_dir(cfg)  # the one-time GGUF conversion is not the load
    model, peak = allocator_peak(lambda: weights.load_model(cfg, r.spec, r.precision, torch.device("cpu")))
    held = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
    assert held > 500 * 2**20  # SmolLM2-135M in fp32
    assert peak <= 1.1 * held, (peak, held)
    planned = analytic.plan(cfg).devices[0].phase_total("load")  # the ledger's load phase
    assert abs(planned - peak) <= 0.05 * peak, (planned, peak)


def test_a_truncated_weights_file_is_one_line(tiny_run, tmp_path):
    import shutil

    root, _ = tiny_run
    broken = tmp_path / "weights"
    shutil.copytree(root / "weights", broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    cfg = C.load(
        None, [f"model.source={broken}", "mode=full", "precision=fp32", "hardware.gpus=cpu", "batch.seq_len=64"]
    )
    r = resolve(cfg)
    with pytest.raises(ConfigError, match=r"^model.source: corrupt weights file .*; re-download or re-convert"):
        weights.load_model(cfg, r.spec, r.precision, torch.device("cpu"))


# a mixture's own fields, tiny: (model_type, config fields, a tensor of the published per-expert layout)
MIXTURES = {
    "mixtral": ({"num_local_experts": 3}, "model.layers.1.block_sparse_moe.experts.2.w1.weight"),
    "qwen3_moe": (
        {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
        "model.layers.1.mlp.experts.2.gate_proj.weight",
    ),
    "glm4_moe": (
        {"n_routed_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1}
        | {"n_group": 1, "topk_group": 1, "head_dim": 8},
        "model.layers.1.mlp.experts.2.up_proj.weight",
    ),
    "deepseek_v3": (
        {"n_routed_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1}
        | {"n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 8}
        | {"qk_rope_head_dim": 8, "v_head_dim": 8},
        "model.layers.1.mlp.experts.2.down_proj.weight",
    ),
}


@pytest.mark.parametrize("model_type", sorted(MIXTURES))
def test_a_mixtures_published_per_expert_weights_load_as_transformers_loads_them(model_type, tiny_run, tmp_path):
    """Each expert's projections are tensors of their own in the files `save_pretrained` writes (and the Hub
    publishes); the model holds them fused and stacked. The loader follows transformers' own conversion rules
    (run/experts.py) and builds what from_pretrained builds, tensor for tensor, the file's bytes copied once into
    the model; a file short of an expert is refused by name."""
    import transformers
    from safetensors.torch import load_file, save_file

    root, _ = tiny_run
    fields, published = MIXTURES[model_type]
    small = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}
    heads = 4 if model_type == "deepseek_v3" else 2
    config = transformers.CONFIG_MAPPING[model_type](**small, **fields, num_key_value_heads=heads, vocab_size=49152)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "w")
    transformers.AutoTokenizer.from_pretrained(root / "weights").save_pretrained(tmp_path / "w")
    (file,) = (tmp_path / "w").glob("*.safetensors")
    assert published in load_file(file)  # the published layout
    sets = [f"model.source={tmp_path / 'w'}", "model.init=auto", "mode=full", "precision=fp32", "hardware.gpus=cpu"]
    cfg = C.load(None, [*sets, "batch.seq_len=32"])
    r = resolve(cfg)
    ours = weights.load_model(cfg, r.spec, r.precision, torch.device("cpu")).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w").state_dict()
    assert set(ours) == set(theirs)
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    tensors = load_file(file)
    del tensors[published]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"^model.source: weights are missing .*{re.escape(published[-30:])}; "):
        weights.load_model(cfg, r.spec, r.precision, torch.device("cpu"))
