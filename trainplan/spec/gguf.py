"""The GGUF file's header: its key/value metadata and tensor names, read directly (no tensor data),
and the transformers config.json it stands for (spec/model.py builds the ModelSpec from that)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from trainplan.errors import ConfigError
from trainplan.files import special

_GGUF_TO_HF = {"llama": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "phi3": "phi3", "gpt2": "gpt2"}


# A header nests arrays no deeper than this (the published layout has none nested; a corrupt one could
# recurse until Python's stack gives out).
MAX_ARRAY_DEPTH = 4


# The versions whose header layout this reader implements (ggml docs/gguf.md): 2 made counts and lengths 64-bit,
# 3 added big-endian files, which announce themselves by a byte-swapped version (an unknown one here).
KNOWN_VERSIONS = (2, 3)


def _read_gguf_header(path: Path) -> tuple[dict, set[str]]:
    """Read a GGUF file's key/value metadata and tensor names, stopping before the tensor data.

    A direct reader of the published GGUF layout (github.com/ggml-org/ggml docs/gguf.md): the
    `gguf` package's reader parses every tensor and token up front (about 2 s for SmolLM2),
    too slow for an instant plan. tests/spec/test_model.py checks this reader against it.

    Every length and count is bounded by the bytes the file has left before anything is read or
    allocated for it: a corrupt or hostile header is a ValueError naming what it claims, never a
    read of 2^62 bytes or a loop over 2^62 items.
    """

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    what = special(path)
    if what:
        raise ValueError(f"it {what}")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(min(size, 1 << 20))
        pos = 0

        def need(n: int, what: str) -> None:
            nonlocal data
            if n > size - pos:
                raise ValueError(
                    f"{what} claims {n:,} bytes, but the file has {size - pos:,} left (truncated or corrupt)"
                )
            while pos + n > len(data):
                data += f.read(max(n, 1 << 20))

        def unpack(fmt: str, what: str):
            nonlocal pos
            nbytes = struct.calcsize(fmt)
            need(nbytes, what)
            (val,) = struct.unpack_from(fmt, data, pos)
            pos += nbytes
            return val

        def count(what: str, least_bytes: int) -> int:
            """An item count, each item at least `least_bytes` long: no more than the file can hold."""
            n = unpack("<Q", what)
            need(n * least_bytes, f"{what} ({n:,} items)")
            return n

        def string(what: str) -> str:
            nonlocal pos
            n = unpack("<Q", what)
            need(n, what)
            pos += n
            return data[pos - n : pos].decode("utf-8", errors="replace")

        def read_value(vtype: int, what: str, depth: int = 0):
            nonlocal pos
            if vtype in scalar:
                return unpack(scalar[vtype], what)
            if vtype == 8:
                return string(what)
            if vtype == 9:  # array: keep only its length, we never need the items
                if depth >= MAX_ARRAY_DEPTH:
                    raise ValueError(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
                itype = unpack("<I", what)
                least = struct.calcsize(scalar[itype]) if itype in scalar else {8: 8, 9: 12}.get(itype, 1)
                n = count(what, least)
                if itype == 8:  # strings (the vocabulary): skip them in a tight loop
                    for _ in range(n):
                        length = unpack("<Q", what)
                        pos += length
                        need(0, what)
                        if pos > size:
                            raise ValueError(f"{what}: a string runs past the end of the file (truncated or corrupt)")
                elif itype in scalar:
                    pos += least * n
                else:
                    for _ in range(n):
                        read_value(itype, what, depth + 1)
                return n
            raise ValueError(f"{what}: unknown GGUF value type {vtype}")

        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        pos = 4
        version = unpack("<I", "the version")
        if version not in KNOWN_VERSIONS:  # another version's layout read as this one would be numbers made up
            raise ValueError(
                f"GGUF version {version} is not one this reader knows ({', '.join(map(str, KNOWN_VERSIONS))})"
            )
        n_tensors = unpack("<Q", "the tensor count")
        n_kv = count("the metadata count", 8 + 4)  # each entry: a key's length and its value's type at least
        meta = {}
        for i in range(n_kv):
            key = string(f"metadata key {i}")
            what = f"metadata {key!r}"  # escaped: a corrupt key's control characters stay on one line
            meta[key] = read_value(unpack("<I", what), what)
        need(n_tensors * (8 + 4 + 4 + 8), f"the tensor count ({n_tensors:,} tensors)")
        names = set()
        for i in range(n_tensors):
            names.add(string(f"tensor {i}'s name"))
            n_dims = unpack("<I", f"tensor {i}'s dimension count")
            need(8 * n_dims, f"tensor {i}'s {n_dims:,} dimensions")
            pos += 8 * n_dims
            unpack("<I", f"tensor {i}'s type")
            unpack("<Q", f"tensor {i}'s offset")
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
