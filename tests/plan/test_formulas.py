"""Hand-worked cases from the literature, each computed here by hand."""

from trainplan.plan import activations as A
from trainplan.plan.analytic import kv_cache_bytes, model_state_bytes_per_param, zero_model_state_bytes
from trainplan.spec.model import AttentionShape, MlpShape, ModelSpec
from trainplan.spec.precision import PRECISIONS

GiB = 2**30


def test_korthikanti_gpt3_175b_layer():
    # s=2048, b=1, h=12288, a=96: sbh = 25,165,824 and 5as/h = 80, so sbh(34 + 80) bytes.
    assert A.korthikanti_layer_bytes(s=2048, b=1, h=12288, a=96) == 114 * 25_165_824 == 2_868_903_936


def test_korthikanti_recompute_variants_with_tensor_parallel():
    kw = dict(s=2048, b=1, h=12288, a=96, t=8)
    sbh = 25_165_824
    # sbh(10 + 24/t + 5as/(ht)) = sbh(10 + 3 + 10)
    assert A.korthikanti_layer_bytes(**kw) == 23 * sbh
    assert A.korthikanti_layer_bytes(**kw, recompute="selective") == 13 * sbh
    assert A.korthikanti_layer_bytes(**kw, recompute="full") == 2 * sbh


def _paper_layer() -> ModelSpec:
    """The paper's layer: GPT-style, LayerNorm, 4h GELU MLP, dropout everywhere."""
    return ModelSpec(
        name="paper",
        model_type="gpt2",
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=256,
        vocab_size=100,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attn=AttentionShape(qkv_bias=True, out_bias=True, fused_qkv=True, dropout=0.1),
        mlp=MlpShape(kind="dense", act="gelu", bias=True),
        norm="layernorm",
        learned_positions=128,
        resid_dropout=0.1,
    )


def test_enumeration_reproduces_korthikanti_under_the_papers_assumptions():
    spec = _paper_layer()
    s, b = 32, 2
    ctx = A.ActContext(
        batch=b,
        seq=s,
        compute_bytes=2,
        residual_bytes=2,
        autocast=False,
        trainable_linears=frozenset(lin.module for lin in spec.layer_linears),
        norms_trainable=True,
        attention="eager",
    )
    saved = A.total(A.layer_saved(spec, ctx))
    layernorm_stats = 2 * (2 * s * b * 4)  # two LayerNorms' fp32 mean + rstd, which the paper ignores
    assert saved - layernorm_stats == A.korthikanti_layer_bytes(s=s, b=b, h=64, a=4)


def test_bytes_per_param_mixed_precision_adamw():
    # ZeRO paper (Rajbhandari et al. 2020): fp16 weights 2 + fp16 grads 2 + fp32 master/m/v 12 = 16.
    assert zero_model_state_bytes(params=1, dp=1, stage=0) == 16
    # HF "Anatomy of a model's memory": amp = fp32 weights 4 + fp16 copy 2 + fp32 grads 4 + Adam 8 = 18.
    assert model_state_bytes_per_param(PRECISIONS["amp-bf16"]) == 18
    assert model_state_bytes_per_param(PRECISIONS["fp32"]) == 16
    assert model_state_bytes_per_param(PRECISIONS["bf16"]) == 8


def test_zero_paper_figure_1_example():
    # 7.5B params on 64 GPUs, K=12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    psi, n = 7_500_000_000, 64
    assert zero_model_state_bytes(params=psi, dp=n, stage=0) == 120_000_000_000
    assert zero_model_state_bytes(params=psi, dp=n, stage=1) == 30_000_000_000 + 1_406_250_000
    assert zero_model_state_bytes(params=psi, dp=n, stage=2) == 15_000_000_000 + 1_640_625_000
    assert zero_model_state_bytes(params=psi, dp=n, stage=3) == 1_875_000_000


def test_deepspeed_bf16_zero2_model_states():
    # DeepSpeed bf16 ZeRO-2 with fp32 gradient accumulation: 2Ψ + 18Ψ/N (K = 4 master + 8 Adam + 4 fp32 grads).
    psi, n = 8_000_000_000, 8
    assert zero_model_state_bytes(params=psi, dp=n, stage=2, k=16) == 2 * psi + 18 * psi // n


def test_kv_cache_llama2_7b_and_llama3_8b():
    # Llama-2-7B, MHA 32 x 128, fp16: 0.5 MiB per token -> 2 GiB for 4096 tokens.
    assert kv_cache_bytes(batch=1, context=4096, layers=32, kv_heads=32, head_dim=128, dtype_bytes=2) == 2 * GiB
    # Llama-3-8B, GQA 8 KV heads: 128 KiB per token -> 1 GiB for 8192 tokens.
    assert kv_cache_bytes(batch=1, context=8192, layers=32, kv_heads=8, head_dim=128, dtype_bytes=2) == GiB
