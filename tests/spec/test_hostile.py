"""Hostile model files: a GGUF header or a config.json that lies about its sizes is one line of bad
input (exit 2) naming what it claims, before anything is read or allocated for it; never a MemoryError,
an OverflowError, a RecursionError or any other internal error (exit 4)."""

from __future__ import annotations

import json
import random
import struct

import pytest

from trainplan import cli
from trainplan.errors import TrainplanError
from trainplan.spec import gguf as G
from trainplan.spec.model import load_model_spec


def _tiny_gguf(path) -> bytes:
    """A small valid GGUF of a tiny Llama (its header, a few tokens, two tensors), written by the
    `gguf` package: what the cases below corrupt."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(256)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list([f"t{i}" for i in range(64)])
    w.add_array("tokenizer.ggml.scores", [0.0] * 64)
    w.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _cases(valid: bytes, n: int, seed: int = 0):
    """(name, bytes): truncations, flipped bytes, planted huge counts and lengths, random headers."""
    rng = random.Random(seed)
    header_end = len(valid) - 64 * 64 * 4 - 64 * 4  # the tensor data sits at the end
    for i in range(n):
        kind = i % 5
        data = bytearray(valid)
        if kind == 0:  # cut anywhere in the header
            data = data[: rng.randrange(0, header_end)]
        elif kind == 1:  # a few bytes flipped
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(4, header_end)] = rng.randrange(256)
        elif kind == 2:  # a count or length that claims the impossible
            at = rng.randrange(8, header_end - 8)
            data[at : at + 8] = struct.pack("<Q", rng.choice([1 << 62, (1 << 64) - 1, 1 << 40, 1 << 31]))
        elif kind == 3:  # a valid magic and version, then noise
            data = bytearray(b"GGUF" + struct.pack("<I", 3) + rng.randbytes(rng.randrange(0, 4096)))
        else:  # noise for counts, then the rest intact
            data[8:24] = rng.randbytes(16)
        yield f"{kind}-{i}", bytes(data)


def test_a_thousand_corrupt_gguf_headers_are_each_bad_input_never_a_crash(tmp_path, capsys):
    valid = _tiny_gguf(tmp_path / "valid.gguf")
    assert load_model_spec(str(tmp_path / "valid.gguf")).num_layers == 2  # the base case reads
    codes: dict[int, int] = {}
    for name, data in _cases(valid, 1000):
        path = tmp_path / "case.gguf"
        path.write_bytes(data)
        code = cli.main(["plan", "--model", str(path), "--gpus", "cpu", "--seq", "64", "--json"])
        codes[code] = codes.get(code, 0) + 1
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (name, code, err[-2000:])  # never 4 (an internal error)
        if code == 2:
            assert len(err.strip().splitlines()) == 1 and ": error: " in err, (name, err)
    assert codes.get(2, 0) >= 800, codes  # most corruptions are caught as bad input (902 of 1,000 on 2026-12-02)


def test_the_reader_bounds_what_a_header_claims_by_the_file(tmp_path):
    """A string length of 2^62, a metadata count of 2^62, arrays nested without end: each is refused
    naming the claim, without reading or allocating it."""
    head = b"GGUF" + struct.pack("<I", 3)
    cases = {
        "a 2^62-byte key": head + struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1 << 62),
        "2^62 metadata entries": head + struct.pack("<QQ", 0, 1 << 62),
        "2^62 tensors": head + struct.pack("<QQ", 1 << 62, 0),
        "nested arrays": head
        + struct.pack("<QQ", 0, 1)
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<I", 9)
        + (struct.pack("<IQ", 9, 1) * 10_000),
    }
    for data in cases.values():
        path = tmp_path / "h.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match="claims|nested|unknown"):
            G._read_gguf_header(path)
        with pytest.raises(TrainplanError, match=r"^model\.source: .*cannot read GGUF metadata"):
            load_model_spec(str(path))


TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
HOSTILE = [  # (change, the key the one line must name)
    ({"num_hidden_layers": -3}, "num_hidden_layers"),
    ({"num_hidden_layers": 10**30}, "num_hidden_layers"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 7}, "num_attention_heads"),  # does not divide hidden_size
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # does not divide the heads
    ({"num_key_value_heads": -2}, "num_key_value_heads"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads"),
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"vocab_size": 256.5}, "vocab_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"hidden_size": {"nested": 1}}, "hidden_size"),
    ({"intermediate_size": [128]}, "intermediate_size"),
    ({"head_dim": -16}, "head_dim"),
    ({"max_position_embeddings": "long"}, "max_position_embeddings"),
    ({"model_type": "mixtral", "num_local_experts": -8, "num_experts_per_tok": 2}, "num_local_experts"),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"attention_dropout": float("nan")}, "attention_dropout"),
    ({"attention_dropout": "0.1"}, "attention_dropout"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    (  # each size in its bounds, together past any machine: the product is refused
        {
            "hidden_size": 1 << 18,
            "num_attention_heads": 4096,
            "num_key_value_heads": 4096,
            "intermediate_size": 1 << 22,
            "num_hidden_layers": 1 << 14,
        },
        "num_hidden_layers",
    ),
]


@pytest.mark.parametrize(("change", "key"), HOSTILE, ids=[json.dumps(c)[:60] for c, _ in HOSTILE])
def test_a_config_json_that_lies_is_one_line_naming_the_key(change, key, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **change}))
    assert cli.main(["plan", "--model", str(path), "--gpus", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainplan plan: error: model.source: "), lines
    assert f"{key} " in lines[0] or f"{key}:" in lines[0], lines[0]
