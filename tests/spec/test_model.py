import json

import pytest

from trainplan.errors import ConfigError
from trainplan.spec import gguf as G
from trainplan.spec import model as M

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_meta_params(cfg: dict) -> int:
    """What transformers reports for the same config built on the meta device (tied weights once)."""
    hf_cfg = transformers.CONFIG_MAPPING[cfg["model_type"]](**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return model.num_parameters()


def _attached(spec: M.ModelSpec) -> M.ModelSpec:
    """An architecture without hand-written terms (Qwen3, Gemma-3) takes its parameter layout from
    transformers' own module (plan/derived.py), as every plan of it does."""
    if not spec.derived:
        return spec
    from trainplan import config as C
    from trainplan.plan import derived
    from trainplan.resolve import resolve

    return derived.attach(resolve(C.load(None, [f"model.source={spec.name}", "hardware.gpus=cpu"]), spec)).spec


@pytest.mark.parametrize("name", M.preset_names())
def test_preset_param_count_equals_transformers(name):
    spec = _attached(M.load_model_spec(name))
    assert spec.num_params == _hf_meta_params(M.preset_config(name))


@pytest.mark.parametrize("name", M.preset_names())
def test_preset_tensor_names_and_shapes_match_transformers(name):
    """Names matter: LoRA targets and FSDP units are matched by them."""
    cfg = M.preset_config(name)
    if cfg["num_hidden_layers" if "num_hidden_layers" in cfg else "n_layer"] > 40:
        cfg = {**cfg, ("num_hidden_layers" if "num_hidden_layers" in cfg else "n_layer"): 2}
    spec = _attached(M.from_hf_config(cfg, name=name))
    hf_cfg = transformers.CONFIG_MAPPING[cfg["model_type"]](**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    ours = {t.name: t.shape for t in spec.tensors}
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == theirs


def test_known_published_sizes():
    """Sanity anchors from the model cards (rounded as they are published)."""
    assert round(M.load_model_spec("Llama-3.1-8B").num_params / 1e9, 2) == 8.03
    assert round(M.load_model_spec("Mixtral-8x7B").num_params / 1e9, 1) == 46.7
    assert M.load_model_spec("GPT-2").num_params == 124_439_808
    mixtral = M.load_model_spec("Mixtral-8x7B")
    assert round(mixtral.active_params_per_token / 1e9, 1) == 12.9


def test_embedded_default_is_smollm2_from_gguf():
    spec = M.load_model_spec("default")
    assert spec.source.endswith(".gguf")
    assert spec.num_params == M.load_model_spec("SmolLM2-135M").num_params
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads) == (30, 576, 3)
    assert spec.tie_word_embeddings
    assert spec.config["rope_theta"] == 100000.0  # not transformers' default of 10000
    assert spec.config["rms_norm_eps"] == pytest.approx(1e-5)


def test_gguf_header_reader_agrees_with_gguf_package():
    gguf = pytest.importorskip("gguf")
    path = M.default_gguf_path()
    meta, names = G._read_gguf_header(path)
    reader = gguf.GGUFReader(str(path))
    assert names == {t.name for t in reader.tensors}
    for key in (
        "llama.block_count",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.context_length",
    ):
        field = reader.fields[key]
        assert meta[key] == field.parts[field.data[0]][0].item(), key
    assert meta["tokenizer.ggml.tokens"] == len(reader.fields["tokenizer.ggml.tokens"].data)


def test_hf_directory_and_config_json(tmp_path):
    cfg = M.preset_config("Qwen2.5-0.5B")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_dir = M.load_model_spec(str(tmp_path))
    from_file = M.load_model_spec(str(tmp_path / "config.json"))
    assert from_dir.num_params == from_file.num_params == M.load_model_spec("Qwen2.5-0.5B").num_params


def test_malformed_config_json_names_file_and_position(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64,,}')
    with pytest.raises(ConfigError, match=r"config\.json: malformed JSON at line 1 column"):
        M.load_model_spec(str(bad))


def test_config_json_with_bad_size_names_the_key(tmp_path):
    cfg = {**M.preset_config("Llama-3.2-1B"), "hidden_size": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^model\.source: .*config\.json: hidden_size must be a positive integer"):
        M.load_model_spec(str(tmp_path / "config.json"))


def test_unknown_preset_suggests_nearest():
    with pytest.raises(ConfigError, match="did you mean 'Llama-3.1-8B'"):
        M.load_model_spec("llama-3.1-8")


def test_corrupt_gguf_is_a_user_error(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"NOTGGUF" + b"\0" * 64)
    with pytest.raises(ConfigError, match="cannot read GGUF metadata"):
        M.load_model_spec(str(f))
