"""Each formula beside a real allocation: the same tiny model, real tensors on the CPU."""

import json

import pytest

from trainplan.plan.analytic import kv_cache_bytes, plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_model(cfg: dict):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg))


def test_weights_gradients_and_adamw_states_match_a_real_step(tmp_path, make_cfg, tiny_llama):
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(tiny_llama))
    led = plan(make_cfg(model__source=str(cfg_path), hardware__gpus="cpu", precision="fp32")).devices[0]

    model = _tiny_model(tiny_llama)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # CPU default: single-tensor loop
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    weights = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters())
    states = sum(t.nbytes for s in opt.state.values() for t in s.values())
    assert led.phases["optimizer"]["weights"] == weights
    assert led.phases["optimizer"]["gradients"] == grads
    assert led.phases["optimizer"]["optimizer"] == states


def test_kv_cache_matches_transformers_cache(tiny_llama):
    model = _tiny_model(tiny_llama).eval()
    ids = torch.randint(0, 256, (3, 20))
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert measured == kv_cache_bytes(batch=3, context=20, layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
