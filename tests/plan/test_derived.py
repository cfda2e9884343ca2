"""Terms derived from a trace for architectures without hand-written ones (plan/derived.py): the
fit, its agreement with a full trace, the cache, and the refusal of what cannot be derived."""

import json
import subprocess
import sys
import time

import pytest

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.plan import analytic, derived, traced

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))


def _config(tmp_path, kind: str, layers: int = 3) -> str:
    if kind == "qwen3":
        hf = transformers.Qwen3Config(num_hidden_layers=layers, tie_word_embeddings=True, **SMALL)
    else:  # Gemma-3: sliding and full attention layers, four norms a layer, q/k norms
        hf = transformers.Gemma3TextConfig(
            num_hidden_layers=layers, sliding_window=16, query_pre_attn_scalar=16, **SMALL
        )
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(hf.to_dict()))
    return str(path)


def _cfg(source: str, *sets: str):
    return C.load(
        None,
        [f"model.source={source}", "model.init=random", "hardware.gpus=cpu", "batch.seq_len=96"]
        + ["batch.micro_batch_size=3", *sets],
    )


def test_the_fit_solves_its_four_points_exactly():
    truth = derived.LayerFit(a=5120.0, c=48.0, e=1024.0, d=4096.0)
    points = {p: truth.nbytes(*p) for p in derived.POINTS}
    fit = derived.LayerFit.from_points(points)
    assert all(fit.nbytes(b, s) == truth.nbytes(b, s) for b, s in [*derived.POINTS, (4, 4096), (1, 32768)])


@pytest.mark.parametrize(
    ("kind", "sets", "bound"),
    [
        ("qwen3", ["mode=full", "precision=amp-bf16"], 0.003),
        ("qwen3", ["mode=full", "precision=fp32", "memory.attention=eager"], 0.003),
        # fitted on two sliding-window layers; its full-attention layers are planned like them
        ("gemma3", ["mode=full", "precision=fp32"], 0.015),
    ],
)
def test_a_derived_plan_agrees_with_the_full_trace(tmp_path, kind, sets, bound):
    """Fitted at seq <= 128 on 1 and 2 layers; checked at seq 96 x 3 on 3 (Qwen3) and 6 layers."""
    cfg = _cfg(_config(tmp_path, kind, layers=3 if kind == "qwen3" else 6), *sets)
    result, _ = traced.trace(cfg)
    ledger = analytic.plan(cfg)
    assert any("derived from a trace" in n for n in ledger.notes)
    led = ledger.devices[0]
    for phase, comps in result.phases.items():
        diff = led.phase_total(phase) - sum(comps.values())
        assert abs(diff) <= bound * result.peak_bytes, (phase, diff)


def test_under_lora_the_first_layer_is_measured_too(tmp_path):
    """LoRA's first layer saves less than the others (its input needs no gradient): measured as what a
    2-layer model saves more once the embedding's output requires a gradient, and planned so (the plan
    was one layer's difference over, +3 % here, when it planned the first layer like the others)."""
    cfg = _cfg(_config(tmp_path, "qwen3"), "mode=lora", "precision=fp32")
    result, r = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    spec = derived.attach(r).spec
    assert spec.first_layer_fit.nbytes(3, 96) < spec.layer_fit.nbytes(3, 96)
    for phase in ("forward", "backward"):
        diff = led.phase_total(phase) - sum(result.phases[phase].values())
        assert abs(diff) <= 0.002 * result.peak_bytes, (phase, diff)


@pytest.mark.parametrize("hf", ["Olmo2Config", "GraniteConfig"])
def test_the_first_layer_measure_counts_no_tensor_that_only_autograd_holds(tmp_path, hf):
    """The first layer's shortfall is measured with the embedding's output requiring a gradient. Made a
    leaf (transformers' enable_input_require_grads), that output is held by autograd's graph to the end
    of backward, though no layer saves it where the first layer does not save its input (OLMo-2 has no
    input norm; Granite's norm saves the scaled embedding): the first layer was one tokens x hidden
    tensor short and the LoRA plan 0.6 % under (2026-12-06). Made to require it through an op that keeps
    nothing, the measure is the layer's own."""
    small = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = getattr(transformers, hf)(num_hidden_layers=3, vocab_size=256, max_position_embeddings=512, **small)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    cfg = _cfg(str(path), "mode=lora", "precision=fp32")
    result, _ = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    layer_in = 3 * 96 * 64 * 4  # one tokens x hidden fp32 tensor: what the plan missed
    for phase in ("forward", "backward"):
        diff = led.phase_total(phase) - sum(result.phases[phase].values())
        assert abs(diff) < layer_in // 4, (phase, diff)


@pytest.mark.multiprocess
def test_a_warm_plan_reads_the_cache_and_imports_no_torch(tmp_path):
    source = _config(tmp_path, "qwen3")
    argv = ["plan", "--model", source, "--gpus", "H100-80GB", "--seq", "256", "--json"]
    code = (
        f"import sys; from trainplan.cli import main; rc = main({argv!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    settings = _cfg(source, "hardware.gpus=H100-80GB", "batch.seq_len=256", "batch.micro_batch_size=1")
    analytic.plan(settings)
    (entry,) = derived.cache_dir(settings.model.cache_dir).glob("qwen3-*.json")  # written by the cold plan
    t0 = time.perf_counter()
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert time.perf_counter() - t0 < 30  # a process start; the figure is in docs/benchmarks.md
    entry.write_text("{not json")  # a damaged cache is derived again, not trusted
    again = analytic.plan(settings)
    assert again.devices[0].peak_allocated > 0 and json.loads(entry.read_text())["fit"]


def test_what_cannot_be_derived_is_refused_naming_what_is_needed(tmp_path):
    path = tmp_path / "encoder.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="unsupported model_type 'bert'.*intermediate_size"):
        analytic.plan(_cfg(str(path)))
    qwen = _config(tmp_path, "qwen3")  # tensor parallelism is derived (tests/run/test_tensor_parallel.py)
    with pytest.raises(ConfigError, match="parallel.pp: qwen3 has no hand-written terms"):
        analytic.plan(_cfg(qwen, "hardware.gpus=2xH100-80GB", "parallel.pp=2", "batch.grad_accum_steps=2"))


@pytest.mark.parametrize(
    ("hf", "attention", "linears"),
    [
        # GPT-NeoX: one fused query_key_value linear, its own MLP names
        (
            "GPTNeoXConfig",
            ("query_key_value",),
            {"query_key_value": (64, 192), "dense": (64, 64), "dense_h_to_4h": (64, 128), "dense_4h_to_h": (128, 64)},
        ),
        # Phi (Phi-2 style): separate q, k, v; dense; fc1 and fc2 reading the same normed input as attention
        (
            "PhiConfig",
            ("q_proj", "v_proj"),
            {
                "q_proj": (64, 64),
                "k_proj": (64, 64),
                "v_proj": (64, 64),
                "dense": (64, 64),
                "fc1": (64, 128),
                "fc2": (128, 64),
            },
        ),
    ],
)
def test_lora_targets_resolve_against_the_models_own_linear_layers(tmp_path, hf, attention, linears):
    """A derived architecture's LoRA targets are its real module's names: "attention" is q and v, or the
    fused qkv by whatever name it has; "all-linear" every linear of a layer; a name it lacks is refused
    with the names it has."""
    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256}
    config = getattr(transformers, hf)(num_hidden_layers=2, max_position_embeddings=128, **small)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    base = [f"model.source={path}", "hardware.gpus=cpu", "batch.seq_len=32", "mode=lora"]
    from trainplan.resolve import resolve

    r = resolve(C.load(None, [*base, 'lora.target_modules=["attention"]']))
    assert tuple(r.cfg.lora.target_modules) == attention
    shapes = {lin.module: (lin.in_features, lin.out_features) for lin in r.spec.layer_linears}
    assert shapes == linears
    every = resolve(C.load(None, [*base, 'lora.target_modules=["all-linear"]']))
    assert sorted(every.cfg.lora.target_modules) == sorted(linears)
    adapter = analytic.plan(every.cfg).devices[0].phases["forward"]["adapter"]
    r8 = 8 * sum(i + o for i, o in linears.values()) * 2  # lora_A and lora_B per linear, 2 layers
    assert adapter >= r8 * 4  # fp32 adapters at least (their gradients and states come on top)
    missing = "gate_proj"
    with pytest.raises(
        ConfigError, match=rf"'{missing}' matches no linear layer .* its linear layers are {', '.join(sorted(linears))}"
    ):
        resolve(C.load(None, [*base, f'lora.target_modules=["{missing}"]']))


@pytest.mark.parametrize("hf", ["PhiConfig", "GPTNeoXConfig"])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_parallel_block_and_fused_qkv_architectures_plan_as_they_trace(tmp_path, hf, mode):
    """Phi (attention and MLP read one normed input in parallel) and GPT-NeoX (one fused qkv linear),
    4 layers at micro-batch 3 x seq 96, against the step on real tensors: full fine-tuning within 2 %
    of the peak, LoRA within 1 % (measured 2026-12-05: +0.7 % and +0.9 %; LoRA +0.06 % and +0.15 %).
    Before the fit read the end of forward, Phi's LoRA plan was 15 % under (a 1-layer model's forward
    peak sits inside its MLP); before the first layer was measured, 17 % over (under LoRA a parallel
    block's first MLP saves nothing)."""
    small = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "vocab_size": 256}
    config = getattr(transformers, hf)(num_hidden_layers=4, max_position_embeddings=512, **small)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    cfg = _cfg(str(path), f"mode={mode}", "precision=fp32")
    result, _ = traced.trace(cfg, real=True)
    ledger = analytic.plan(cfg)
    for phase in ("forward", "backward"):
        diff = ledger.devices[0].phase_total(phase) - sum(result.phases[phase].values())
        assert abs(diff) <= (0.02 if mode == "full" else 0.01) * result.peak_bytes, (phase, diff)
