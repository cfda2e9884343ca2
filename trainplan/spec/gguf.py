"""The GGUF file's header: its key/value metadata and tensor names, read directly (no tensor data),
and the transformers config.json it stands for (spec/model.py builds the ModelSpec from that)."""

from __future__ import annotations

import struct
from pathlib import Path

from trainplan.errors import ConfigError

_GGUF_TO_HF = {"llama": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "phi3": "phi3", "gpt2": "gpt2"}


def _read_gguf_header(path: Path) -> tuple[dict, set[str]]:
    """Read a GGUF file's key/value metadata and tensor names, stopping before the tensor data.

    A direct reader of the published GGUF layout (github.com/ggml-org/ggml docs/gguf.md): the
    `gguf` package's reader parses every tensor and token up front (about 2 s for SmolLM2),
    too slow for an instant plan. tests/spec/test_model.py checks this reader against it.
    """

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        data = f.read(1 << 20)
        pos = 0

        def need(n: int) -> None:
            nonlocal data
            while pos + n > len(data):
                chunk = f.read(max(n, 1 << 20))
                if not chunk:
                    raise EOFError("truncated GGUF header")
                data += chunk

        def unpack(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            (val,) = struct.unpack_from(fmt, data, pos)
            pos += size
            return val

        def string() -> str:
            nonlocal pos
            n = unpack("<Q")
            need(n)
            pos += n
            return data[pos - n : pos].decode("utf-8", errors="replace")

        def read_value(vtype: int):
            nonlocal pos
            if vtype in scalar:
                return unpack(scalar[vtype])
            if vtype == 8:
                return string()
            if vtype == 9:  # array: keep only its length, we never need the items
                itype, count = unpack("<I"), unpack("<Q")
                if itype == 8:  # strings (the vocabulary): skip them in a tight loop
                    for _ in range(count):
                        need(8)
                        pos += 8 + int.from_bytes(data[pos : pos + 8], "little")
                    need(0)
                elif itype in scalar:
                    size = struct.calcsize(scalar[itype]) * count
                    need(size)
                    pos += size
                else:
                    for _ in range(count):
                        read_value(itype)
                return count
            raise ValueError(f"unknown GGUF value type {vtype}")

        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        pos = 4
        version = unpack("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        n_tensors, n_kv = unpack("<Q"), unpack("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = read_value(unpack("<I"))
        names = set()
        for _ in range(n_tensors):
            names.add(string())
            n_dims = unpack("<I")
            for _ in range(n_dims):
                unpack("<Q")
            unpack("<I")
            unpack("<Q")
    return meta, names


def gguf_config(path: Path) -> dict:
    """Translate a GGUF file's metadata into a transformers-style config dict."""
    try:
        meta, tensor_names = _read_gguf_header(path)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(
            "model.source", f"{path}: cannot read GGUF metadata ({e})", "pass a valid .gguf file"
        ) from None
    arch = meta.get("general.architecture")
    if arch not in _GGUF_TO_HF:
        raise ConfigError(
            "model.source", f"{path}: unsupported architecture {arch!r}", "supported: " + ", ".join(_GGUF_TO_HF)
        )
    heads = meta.get(f"{arch}.attention.head_count")
    cfg = {
        "model_type": _GGUF_TO_HF[arch],
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "num_hidden_layers": meta.get(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or heads,
        "intermediate_size": meta.get(f"{arch}.feed_forward_length"),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
        "vocab_size": meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    # numerics the architecture needs beyond sizes: RoPE base and the norm epsilon
    if meta.get(f"{arch}.rope.freq_base"):
        cfg["rope_theta"] = float(meta[f"{arch}.rope.freq_base"])
    if meta.get(f"{arch}.attention.layer_norm_rms_epsilon"):
        cfg["rms_norm_eps"] = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    if meta.get(f"{arch}.attention.key_length"):
        cfg["head_dim"] = meta[f"{arch}.attention.key_length"]
    if meta.get(f"{arch}.expert_count"):
        cfg.update(
            model_type="mixtral",
            num_local_experts=meta[f"{arch}.expert_count"],
            num_experts_per_tok=meta.get(f"{arch}.expert_used_count"),
        )
    return cfg
