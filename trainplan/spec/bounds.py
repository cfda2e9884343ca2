"""What a model's config may claim: every size an integer in bounds far above any released model, the
sizes agreeing with each other, their product within reach. spec/model.py checks each ModelSpec it
builds from a config.json or a GGUF header here, so a corrupt or hostile file is one line of bad input
naming its key, never an overflow later."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError

if TYPE_CHECKING:
    from trainplan.spec.model import ModelSpec

# Bounds on a config's sizes, far above every released model (Llama-3.1-405B: hidden 16,384, MLP 53,248,
# 126 layers, 128 heads; Gemma: vocabulary 256,000; DeepSeek-V3: 256 experts; Llama-4 Scout: 10M
# positions): a corrupt or hostile value is refused, naming its key, before any arithmetic runs on it.
# (spec field, its config.json keys, least, most)
SIZE_BOUNDS = (
    ("hidden_size", ("hidden_size", "n_embd"), 1, 1 << 20),
    ("intermediate_size", ("intermediate_size", "n_inner"), 1, 1 << 22),
    ("num_layers", ("num_hidden_layers", "n_layer"), 1, 1 << 14),
    ("num_heads", ("num_attention_heads", "n_head"), 1, 1 << 14),
    ("num_kv_heads", ("num_key_value_heads",), 1, 1 << 14),
    ("head_dim", ("head_dim",), 1, 1 << 16),
    ("vocab_size", ("vocab_size",), 1, 1 << 24),
    ("max_position_embeddings", ("max_position_embeddings", "n_positions"), 1, 1 << 32),
)
MAX_PARAMS = 1 << 50  # a thousand times the largest released model


def checked(spec: ModelSpec, cfg: dict, where: str) -> ModelSpec:
    """The spec, once every size read from the config is an integer in its bounds and they fit together."""

    def key(names: tuple[str, ...]) -> str:
        return next((k for k in names if k in cfg), names[0])

    def refuse(keys: tuple[str, ...], problem: str) -> ConfigError:
        return ConfigError("model.source", f"{where}: {key(keys)} {problem}", "fix the config value")

    for attr, keys, least, most in SIZE_BOUNDS:
        value = getattr(spec, attr)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise refuse(keys, f"must be an integer from {least} to {most:,} (got {value!r})")
    if spec.num_heads % spec.num_kv_heads:
        raise refuse(
            ("num_key_value_heads",), f"{spec.num_kv_heads} does not divide num_attention_heads {spec.num_heads}"
        )
    moe = spec.mlp
    for attr, keys, least in (
        ("num_experts", ("num_local_experts",), 0),
        ("experts_per_token", ("num_experts_per_tok",), 0),
    ):
        value = getattr(moe, attr)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 1 << 16:
            raise refuse(keys, f"must be an integer from {least} to {1 << 16:,} (got {value!r})")
    if moe.num_experts and not 1 <= moe.experts_per_token <= moe.num_experts:
        raise refuse(
            ("num_experts_per_tok",), f"{moe.experts_per_token} must be from 1 to num_local_experts {moe.num_experts}"
        )
    for value, keys in (
        (spec.attn.dropout, ("attention_dropout", "attn_pdrop")),
        (spec.resid_dropout, ("resid_pdrop",)),
        (spec.embd_dropout, ("embd_pdrop",)),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise refuse(keys, f"must be a probability from 0 to below 1 (got {value!r})")
    if (
        isinstance(spec.attn.softcap, bool)
        or not isinstance(spec.attn.softcap, int | float)
        or not 0 <= spec.attn.softcap < 1e6
    ):
        raise refuse(("attn_logit_softcapping",), f"must be a finite number >= 0 (got {spec.attn.softcap!r})")
    if not isinstance(spec.tie_word_embeddings, bool):
        raise refuse(("tie_word_embeddings",), f"must be true or false (got {spec.tie_word_embeddings!r})")
    if not isinstance(spec.mlp.act, str):
        raise refuse(("hidden_act", "activation_function"), f"must be a string (got {spec.mlp.act!r})")
    h, inter, layers = spec.hidden_size, spec.intermediate_size, spec.num_layers
    params = layers * (4 * h * max(h, spec.q_dim) + 3 * h * inter * max(1, moe.num_experts)) + 2 * spec.vocab_size * h
    if params > MAX_PARAMS:
        raise refuse(
            ("num_hidden_layers", "n_layer"),
            f"x the layer sizes make about {params:.2e} parameters, past {MAX_PARAMS:.1e}",
        )
    return spec
