"""The chunked fused loss: the same loss and gradients as transformers' loss, without the
(tokens x vocab) buffers."""

import json

import pytest

from trainplan import config as C
from trainplan import resolve
from trainplan.plan import analytic, traced
from trainplan.run import build, loss, step

torch = pytest.importorskip("torch")


def _cfg(tmp_path, model_config: dict, *sets: str):
    path = tmp_path / f"{model_config['model_type']}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(model_config))
    base = [f"model.source={path}", "hardware.gpus=cpu", "batch.seq_len=32", "batch.micro_batch_size=2"]
    return C.load(None, [*base, *sets])


def _pair(cfg):
    """The same randomly initialised model twice: with the fused head, and with transformers' loss."""
    r = resolve.resolve(cfg)
    models = []
    for fused in (True, False):
        c = cfg if fused else _with(cfg, fused_loss=False)
        torch.manual_seed(0)
        models.append(build.materialize(build.build_model(r.spec, c, r.precision), "cpu"))
    return r, models


def _with(cfg, **train):
    import dataclasses

    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def _batch(vocab: int, seed: int = 1):
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 32))
    labels = ids.clone()
    labels[0, :7] = -100  # a masked prompt: no loss on these targets
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [7, 64, 128])  # uneven, exactly the tokens, larger than them
def test_loss_and_every_gradient_match_transformers(tmp_path, tiny_llama, tied, chunk):
    cfg = _cfg(tmp_path, {**tiny_llama, "tie_word_embeddings": tied}, "precision=fp32", "mode=full")
    cfg = _with(cfg, loss_chunk_tokens=chunk)
    _, (fused, plain) = _pair(cfg)
    assert loss.fused_head(fused) is not None and loss.fused_head(plain) is None
    batch = _batch(tiny_llama["vocab_size"])
    for num_items in (50, None):  # the accumulation window's token count, or this batch's own
        for m in (fused, plain):
            m.zero_grad(set_to_none=True)
        a = loss.causal_lm_loss(fused, batch, num_items)
        b = loss.causal_lm_loss(plain, batch, num_items)
        a.backward()
        b.backward()
        assert a.item() == pytest.approx(b.item(), rel=1e-6)
        for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_lora_under_bf16_autocast_matches_within_bf16_rounding(tmp_path, tiny_llama):
    cfg = _cfg(tmp_path, tiny_llama, "precision=amp-bf16", "mode=lora")
    _, (fused, plain) = _pair(cfg)
    batch = _batch(tiny_llama["vocab_size"])
    out = []
    for m in (fused, plain):
        torch.manual_seed(2)  # the same LoRA dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss.causal_lm_loss(m, batch, 57)
        value.backward()
        out.append((value.dtype, value.item(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (dt_a, a, ga), (dt_b, b, gb) = out
    assert dt_a == dt_b == torch.float32
    assert a == pytest.approx(b, rel=1e-3)
    assert ga.keys() == gb.keys() and ga
    for name in ga:  # bf16 matmuls in both, summed in another order: compare whole tensors
        assert torch.linalg.vector_norm(ga[name] - gb[name]) <= 0.02 * torch.linalg.vector_norm(gb[name]), name


def test_without_targets_the_head_returns_logits(tmp_path, tiny_llama):
    """Evaluation and generation see ordinary logits: the head is only fused inside the loss."""
    cfg = _cfg(tmp_path, tiny_llama, "precision=fp32", "mode=full")
    _, (fused, plain) = _pair(cfg)
    ids = _batch(tiny_llama["vocab_size"])["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
        a = loss.causal_lm_loss(fused, {"input_ids": ids, "labels": ids})  # no graph: no gradients kept
    assert a.requires_grad is False


def test_training_steps_follow_the_same_trajectory(tmp_path, tiny_llama):
    cfg = _cfg(tmp_path, tiny_llama, "precision=fp32", "mode=full")
    r, models = _pair(cfg)
    losses = []
    for m in models:
        opt = step.build_optimizer(m, "adamw", "auto", 1e-2, 0.0, "cpu")
        seq = []
        for _ in range(4):  # one batch, four times: the loss must fall
            settings = step.StepSettings(prec=r.precision, device_type="cpu")
            res = step.train_step(m, step.Update(opt), [_batch(tiny_llama["vocab_size"])], settings)
            seq.append(float(res.loss))
        losses.append(seq)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0][-1] < losses[0][0]


def test_the_fused_step_drops_the_logits_buffers(tmp_path, tiny_llama):
    """Measured on real tensors: with a 16k vocabulary the (tokens x vocab) fp32 buffers dominate
    the unfused step; the fused one keeps a 16-token chunk of them."""
    big_vocab = {**tiny_llama, "vocab_size": 16384}
    cfg = _cfg(tmp_path, big_vocab, "precision=fp32", "mode=lora", "train.loss_chunk_tokens=16")
    fused, _ = traced.trace(cfg, real=True)
    plain, _ = traced.trace(_with(cfg, fused_loss=False), real=True)
    tv = 2 * 32 * 16384 * 4  # one fp32 (tokens x vocab) buffer: 4 MiB
    for phase in ("forward", "backward"):
        saved = sum(plain.phases[phase].values()) - sum(fused.phases[phase].values())
        assert saved >= 1.5 * tv, (phase, saved)
    # and the planner knows it: its fused ledger matches the fused trace
    led = analytic.plan(cfg).devices[0]
    for phase, comps in fused.phases.items():
        assert abs(led.phase_total(phase) - sum(comps.values())) <= 0.003 * fused.peak_bytes, phase


def test_applies_only_where_the_head_is_the_whole_output(tmp_path, tiny_llama):
    gemma = {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "final_logit_softcapping": 30.0,
    }
    cases = {
        "llama": (_cfg(tmp_path, tiny_llama, "precision=fp32"), True),
        "fused_loss=false": (_cfg(tmp_path, tiny_llama, "precision=fp32", "train.fused_loss=false"), False),
        "inference": (_cfg(tmp_path, tiny_llama, "precision=fp32", "mode=inference"), False),
        "gemma2 soft-capping": (_cfg(tmp_path, gemma, "precision=fp32", "memory.attention=eager"), False),
    }
    for name, (cfg, expected) in cases.items():
        r = resolve.resolve(cfg)
        model = build.build_model(r.spec, cfg, r.precision)
        assert (loss.fused_head(model) is not None) is expected, name
        assert r.fused_loss is expected, name


def test_chunk_size_is_validated():
    with pytest.raises(ValueError, match=r"train\.loss_chunk_tokens"):
        C.load(None, ["train.loss_chunk_tokens=0"])


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_evaluation_through_the_chunked_head_matches_the_logits_path(tmp_path, tiny_llama, precision):
    """Evaluation used to compute the full (tokens x vocab) logits even where training never does:
    at seq 4096 with a 128k vocabulary that made evaluation, not the step, the run's peak."""
    from trainplan.run import evaluate, measure

    wide = {**tiny_llama, "vocab_size": 4096}  # the logits, not a layer, are the widest moment
    cfg = _with(_cfg(tmp_path, wide, f"precision={precision}", "mode=full"), loss_chunk_tokens=7)
    r, (fused, plain) = _pair(cfg)
    batch = _batch(wide["vocab_size"])
    ids = torch.cat([batch["input_ids"], batch["input_ids"].flip(1)])
    labels = torch.cat([batch["labels"], batch["labels"].flip(1)])
    prec = r.precision
    got, peaks = [], []
    for m in (fused, plain):
        with measure.PhaseMeter(torch.device("cpu"), m) as meter:
            got.append(evaluate.evaluate(m, ids, labels, micro_batch=3, max_batches=0, prec=prec, device=meter.device))
        peaks.append(meter.peak_bytes)
    logits = 3 * 32 * wide["vocab_size"] * 4  # one micro-batch's fp32 logits
    assert peaks[0] + logits <= peaks[1], peaks  # the chunked path holds a 7-token chunk of them
    assert got[0]["tokens"] == got[1]["tokens"] == int((labels[:, 1:] != -100).sum())
    assert got[0]["loss"] == pytest.approx(got[1]["loss"], rel=1e-5 if precision == "fp32" else 2e-3)
    assert got[0]["token_accuracy"] == pytest.approx(got[1]["token_accuracy"], abs=0.02)
