"""Seeded generators of hostile files for tests/test_hostile_files.py's fuzz (issue 49): for each
reader trainplan has, files that are wrong in one of the ways a file from outside can be wrong
(bytes that are not text, another encoding, nesting thousands deep, the wrong type where a value
belongs, a key or value a megabyte long, control characters). Each case is (class, builder): the
builder writes its files under a directory and returns the argv that reads them and the pattern
the one-line error must match. Generated, not listed: a seed gives another draw of the same classes."""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

from tests.conftest import TINY  # the suite's tiny Llama, as config.json

Builder = Callable[[Path], tuple[list[str], str]]

# the settings a config file holds, with a value of the right type for each
SETTINGS = {
    "mode": "lora",
    "precision": "fp32",
    "model.source": "GPT-2",
    "lora.r": 8,
    "optim.lr": 1e-4,
    "optim.name": "adamw",
    "batch.seq_len": 64,
    "batch.micro_batch_size": 1,
    "parallel.strategy": "ddp",
    "memory.activation_checkpointing": False,
    "hardware.gpus": "cpu",
    "hardware.cuda_context_mib": 600,
    "data.eval_fraction": 0.1,
    "train.steps": 3,
    "train.seed": 0,
    "checkpoint.every": 1,
}


def _garbage(rng: random.Random, n: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(n))


def _control(rng: random.Random) -> str:
    return rng.choice(["\x1b[2J", "\x1b]0;x\x07", "\x00", "\r", "\x7f", "\x9b31m", "\x08"])


def _wrong_value(rng: random.Random, right):
    """A value of another type than `right`'s (or of its type, out of any range)."""
    choices = [[1, 2], {"a": 1}, "x" * rng.randrange(1, 5), True, -(10 ** rng.randrange(1, 30)), 1e308 * 10, None]
    if isinstance(right, bool):
        choices = [c for c in choices if not isinstance(c, bool)] + ["yes", 2]
    elif isinstance(right, int | float):
        choices = [c for c in choices if isinstance(c, str | list | dict | bool) or (c is not None and c < 0)]
        choices += [float("nan"), float("inf")] if isinstance(right, float) else [0.5, 10**25]
    else:
        choices = [c for c in choices if not isinstance(c, str)] + [_control(rng) + "x"]
    value = rng.choice([c for c in choices if c is not None])
    return value


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {float("nan"): "nan"}.get(v, "nan" if v != v else ("inf" if v == float("inf") else repr(v)))
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: escapes as JSON writes them
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _toml_lines(settings: dict) -> str:
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in settings.items())


# ---- the classes -------------------------------------------------------------------------------

CONFIG_COMMANDS = (["plan"], ["trace"], ["train"], ["launch", "--target", "torchrun"])


def config_case(rng: random.Random) -> Builder:
    """A TOML config given as the run's config file, wrong in one way."""
    kind = rng.choice(["bytes", "utf16", "deep", "wrong-type", "unknown-key", "long-key", "control-key", "truncated"])
    command = rng.choice(CONFIG_COMMANDS)
    key = rng.choice(sorted(SETTINGS))

    def build(d: Path) -> tuple[list[str], str]:
        f = d / "run.toml"
        good = {k: v for k, v in SETTINGS.items() if rng.random() < 0.3}
        pattern = r"^(config|run|[a-z_]+(\.[a-z_]+)?): "
        if kind == "bytes":
            f.write_bytes(b"\x00" + _garbage(rng, rng.randrange(1, 400)))
        elif kind == "utf16":
            f.write_bytes(_toml_lines(good or {"mode": "lora"}).encode("utf-16"))
            pattern = r"^config: .* is UTF-16 text"
        elif kind == "deep":
            depth = rng.randrange(200, 5000)
            f.write_text(f"{key.split('.')[-1]} = " + "[" * depth + "]" * depth + "\n")
        elif kind == "wrong-type":
            f.write_text(_toml_lines({**good, key: _wrong_value(rng, SETTINGS[key])}))
            pattern = rf"^({re.escape(key)}|run|hardware\.gpus|model\.source): "
        elif kind in ("unknown-key", "long-key", "control-key"):
            pattern = r": unknown (section or )?setting"
        if kind == "unknown-key":
            name = "".join(rng.choice("abcdefghij_") for _ in range(rng.randrange(3, 12)))
            f.write_text(_toml_lines({**good, f"{key.split('.')[0]}.{name}" if "." in key else name: 1}))
        if kind == "long-key":
            f.write_text(_toml_lines({**good, "k" * rng.randrange(10_000, 200_000): 1}))
        if kind == "control-key":
            f.write_text(_toml_lines(good) + f'"{json.dumps(_control(rng))[1:-1]}" = 1\n')
        if kind == "truncated":  # a file cut mid-value
            text = _toml_lines({**SETTINGS, key: "x" * 50})
            f.write_text(text[: text.index(key) + len(key) + rng.randrange(3, 20)])
        return [*command, str(f)], pattern

    return build


def model_case(rng: random.Random) -> Builder:
    """A config.json given as --model, wrong in one way."""
    kind = rng.choice(["bytes", "deep", "wrong-type", "missing", "not-object", "model-type", "huge"])
    command = rng.choice(["plan", "trace", "advise"])
    key = rng.choice(sorted(k for k in TINY if k not in ("architectures",)))
    required = rng.choice(
        ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    )

    def build(d: Path) -> tuple[list[str], str]:
        f = d / "config.json"
        cfg = dict(TINY)
        if kind == "bytes":
            f.write_bytes(_garbage(rng, rng.randrange(1, 400)) + b"\x00")
        elif kind == "deep":
            depth = rng.randrange(200, 20_000)
            f.write_text('{"hidden_size": ' + "[" * depth + "]" * depth + "}")
        elif kind == "wrong-type":
            cfg[key] = _wrong_value(rng, cfg[key])
            f.write_text(json.dumps(cfg))
        elif kind == "missing":
            del cfg[required]  # (num_key_value_heads or max_position_embeddings have defaults)
            f.write_text(json.dumps(cfg))
        elif kind == "not-object":
            f.write_text(json.dumps(rng.choice([[1, 2], "llama", 7, None, True])))
        elif kind == "model-type":
            cfg["model_type"] = rng.choice(["", "LLAMA", "t5", "bert", "florble" + str(rng.randrange(99)), "x" * 5000])
            cfg.pop("architectures", None)
            f.write_text(json.dumps(cfg))
        else:
            cfg[key if key != "model_type" else "hidden_size"] = 10 ** rng.randrange(12, 40)
            f.write_text(json.dumps(cfg))
        argv = ["advise", str(f), "--registry", "off"] if command == "advise" else [command, "--model", str(f)]
        return [*argv, "--gpus", "cpu"], r"^(model\.source|batch\.seq_len|--global-batch): "

    return build


def data_case(rng: random.Random) -> Builder:
    """Training data (data.source) that is not data: `train` reads it before any model is built."""
    kind = rng.choice(
        ["nulls", "deep", "bytes", "latin1", "scalars", "bad-line", "mixed-dir", "binary-dir", "parquet", "csv"]
    )
    suffix = {"parquet": ".parquet", "csv": ".csv"}.get(kind, rng.choice([".jsonl", ".json"]))

    def build(d: Path) -> tuple[list[str], str]:
        f = d / f"data{suffix}"
        rows = [json.dumps({"text": f"row {i}"}) for i in range(rng.randrange(1, 6))]
        if kind == "nulls":
            f.write_text("null\n" * rng.randrange(1, 50))
        elif kind == "deep":
            depth = rng.randrange(200, 20_000)
            f.write_text('{"text": ' + "[" * depth + "]" * depth + "}\n")
        elif kind == "bytes":
            f.write_bytes(_garbage(rng, rng.randrange(1, 400)) + b"\x00")
        elif kind == "latin1":
            f.write_bytes('{"text": "café"}\n'.encode("latin-1"))
        elif kind == "scalars":
            f.write_text("\n".join(json.dumps(rng.choice([1, "s", [1], True])) for _ in range(3)) + "\n")
        elif kind == "bad-line":
            rows.insert(rng.randrange(len(rows) + 1), rng.choice(['{"text": ', "{'text': 'x'}", "[1,", "\x00"]))
            f.write_text("\n".join(rows) + "\n")
        elif kind == "parquet":  # not parquet: random bytes, or the magic around garbage
            f.write_bytes(rng.choice([b"", b"PAR1"]) + _garbage(rng, rng.randrange(1, 300)) + b"PAR1")
        elif kind == "csv":
            f.write_bytes(rng.choice([b"a,b\n1,2\n", b"text\n\x00\xff\n", b"\n", b'text\n"unterminated\n']))
        elif kind == "mixed-dir":
            f = d / "data"
            f.mkdir()
            (f / "a.jsonl").write_text(rows[0] + "\n")
            (f / "b.txt").write_text("plain\n")
        else:
            f = d / "data"
            f.mkdir()
            for i in range(rng.randrange(1, 4)):
                (f / f"{i}.txt").write_bytes(_garbage(rng, 300) + b"\x00")
        argv = ["train", "--model", str(d / "tiny.json"), "--set", "model.init=random", "--set", f"data.source={f}"]
        (d / "tiny.json").write_text(json.dumps(TINY))
        return [*argv, "--seq", "32", "--output-dir", str(d / "out")], r"^data\.source: "

    return build


def record_case(rng: random.Random) -> Builder:
    """A run directory whose record.json is not trainplan's, given to export."""
    content = rng.choice(
        [
            lambda: _garbage(rng, rng.randrange(1, 300)) + b"\x00",
            lambda: b"[" * rng.randrange(100, 50_000),
            lambda: json.dumps(rng.choice([[], {}, {"config": 5}, {"config": {"mode": 7}}, "x"])).encode(),
            lambda: '{"config": {"mode": "lora"}'.encode("utf-16"),
        ]
    )

    def build(d: Path) -> tuple[list[str], str]:
        run = d / "run"
        (run / "result").mkdir(parents=True)
        (run / "result" / "adapter_config.json").write_text("{}")
        (run / "record.json").write_bytes(content())
        return ["export", str(run), "-o", str(d / "exported")], r"^RUN_OR_CHECKPOINT: .*record\.json"

    return build


COLUMNS_SQL = (
    "id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT, started TEXT, config_hash TEXT, model TEXT, mode TEXT, "
    "device TEXT, devices TEXT, peaks_json TEXT, metric TEXT, metric_before REAL, metric_after REAL, "
    "wall_seconds REAL, train_seconds REAL, tokens_per_s REAL, verdict TEXT, output_dir TEXT, config_toml TEXT"
)


def registry_case(rng: random.Random) -> Builder:
    """A --registry file that is not a trainplan registry, or one whose rows hold the wrong types."""
    kind = rng.choice(["bytes", "other-app", "other-schema", "bad-row"])
    action = rng.choice([["list"], ["show", "1"], ["compare", "1", "2"]])

    def build(d: Path) -> tuple[list[str], str]:
        db = d / "runs.db"
        if kind == "bytes":
            db.write_bytes(_garbage(rng, rng.randrange(100, 4000)))
        else:
            con = sqlite3.connect(db)
            with con:
                if kind == "other-app":
                    con.execute(f"CREATE TABLE t{rng.randrange(99)} (x TEXT)")
                elif kind == "other-schema":
                    con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
                else:
                    con.execute(f"CREATE TABLE runs ({COLUMNS_SQL})")
                    column = rng.choice(["wall_seconds", "metric_after", "peaks_json", "model", "config_toml"])
                    bad = {"peaks_json": rng.choice(["[" * 3000, '{"a": "b"}', "7"]), "model": b"\x00\x01"}
                    value = bad.get(column, b"\xff" if column == "config_toml" else "fast")
                    for i in (1, 2):
                        con.execute(
                            f"INSERT INTO runs (id, kind, started, config_hash, model, mode, {column}) "
                            "VALUES (?, 'train', 'x', 'h', 'm', 'lora', ?)"
                            if column != "model"
                            else "INSERT INTO runs (id, kind, started, config_hash, model, mode) "
                            "VALUES (?, 'train', 'x', 'h', ?, 'lora')",
                            (i, value),
                        )
            con.close()
        return ["runs", *action, "--registry", str(db)], r"^--registry: "

    return build


def checkpoint_case(rng: random.Random) -> Builder:
    """A step-N checkpoint whose manifest or state is not what trainplan wrote, given to export."""
    part = rng.choice(["manifest.json", "state.json"])
    content = rng.choice(
        [
            lambda: _garbage(rng, rng.randrange(1, 300)),
            lambda: b"{" * rng.randrange(100, 50_000),
            lambda: json.dumps(rng.choice([[], 5, {"schema": 3}, {"parts": "x"}])).encode(),
        ]
    )

    def build(d: Path) -> tuple[list[str], str]:
        step = d / "ck" / "step-00000002"
        step.mkdir(parents=True)
        manifest = {"schema": "trainplan.checkpoint/1", "complete": True, "step": 2, "parts": {}}
        (step / "manifest.json").write_text(json.dumps(manifest))
        (step / "state.json").write_text(json.dumps({"step": 2, "mode": "lora"}))
        (step / part).write_bytes(content())
        return ["export", str(step), "-o", str(d / "exported")], r"^RUN_OR_CHECKPOINT: "

    return build


def output_case(rng: random.Random) -> Builder:
    """An output path no one can type, or a file output written as a directory."""
    command = rng.choice([["plan", "--model", "GPT-2", "-o"], ["advise", "GPT-2", "--registry", "off", "--out"]])

    def build(d: Path) -> tuple[list[str], str]:
        name = rng.choice([f"a{_control(rng)}b.json", "x\nrm -rf y", "newdir/", " ", f"{_control(rng)}"])
        return [*command, name], r"^argument (--output/-o|--out): "

    return build


def gguf_case(rng: random.Random) -> Builder:
    """A .gguf given as the model that is not one: another magic, a header cut short, counts that lie."""
    kind = rng.choice(["bytes", "magic-only", "huge-counts", "bad-version"])

    def build(d: Path) -> tuple[list[str], str]:
        f = d / "model.gguf"
        if kind == "bytes":
            f.write_bytes(_garbage(rng, rng.randrange(0, 400)))
        elif kind == "magic-only":
            f.write_bytes(b"GGUF" + _garbage(rng, rng.randrange(0, 12)))
        elif kind == "huge-counts":  # version 3, 2^63 tensors, 2^63 metadata keys
            f.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**63).to_bytes(8, "little") * 2)
        else:
            f.write_bytes(b"GGUF" + rng.choice([0, 1, 99, 2**31]).to_bytes(4, "little") + bytes(16))
        command = rng.choice([["plan", "--model"], ["trace", "--model"], ["advise", "--registry", "off"]])
        return [*command, str(f), "--gpus", "cpu"], r"^model\.source: "

    return build


def prompts_case(rng: random.Random) -> Builder:
    """generate --prompts with a file that is not prompts (read before any model loads)."""
    suffix = rng.choice([".txt", ".jsonl"])
    content = rng.choice(
        [
            lambda: _garbage(rng, rng.randrange(1, 300)) + b"\x00",
            lambda: "café\n".encode("latin-1"),
            lambda: b"\n \n",
            lambda: b'{"prompt": ' + b"[" * rng.randrange(100, 20_000) + b"}\n",
            lambda: rng.choice([b"[1]\n", b'{"text": "x"}\n', b'{"prompt": 7}\n', b"{\n"]),
        ]
    )

    def build(d: Path) -> tuple[list[str], str]:
        f = d / f"prompts{suffix}"
        data = content()
        if suffix == ".txt" and data.startswith((b"[", b"{")) and b"\x00" not in data:
            data = b"\x00" + data  # in a .txt, JSON is just a prompt: make it bad another way
        f.write_bytes(data)
        return ["generate", "default", "--prompts", str(f)], r"^--prompts: "

    return build


def resume_case(rng: random.Random) -> Builder:
    """train with checkpoint.resume naming a directory that is not a usable checkpoint."""
    kind = rng.choice(["empty", "manifest-bytes", "manifest-deep", "parts-lie", "not-a-dir"])

    def build(d: Path) -> tuple[list[str], str]:
        step = d / "ck" / "step-00000002"
        step.mkdir(parents=True)
        if kind == "manifest-bytes":
            (step / "manifest.json").write_bytes(_garbage(rng, 200))
        elif kind == "manifest-deep":
            (step / "manifest.json").write_bytes(b"[" * rng.randrange(1000, 50_000))
        elif kind == "parts-lie":
            parts = {"state.json": {"bytes": 10**12, "sha256": "0" * 64}, "../../etc/passwd": {"bytes": 1}}
            manifest = {"schema": "trainplan.checkpoint/1", "complete": True, "step": 2, "parts": parts}
            (step / "manifest.json").write_text(json.dumps(manifest))
        elif kind == "not-a-dir":
            step.rmdir()
            step.write_bytes(_garbage(rng, 50))
        (d / "tiny.json").write_text(json.dumps({**TINY, "vocab_size": 49152}))  # the default tokenizer's
        argv = ["train", "--model", str(d / "tiny.json"), "--set", "model.init=random", "--seq", "32"]
        return [*argv, "--set", f"checkpoint.resume={step}", "--output-dir", str(d / "out")], r"^checkpoint\.resume: "

    return build


CLASSES = {
    "config": config_case,
    "model": model_case,
    "data": data_case,
    "record": record_case,
    "registry": registry_case,
    "checkpoint": checkpoint_case,
    "output": output_case,
    "gguf": gguf_case,
    "prompts": prompts_case,
    "resume": resume_case,
}
# cases per class: the cheap readers drawn more often than train's data (a model config per case)
COUNTS = {"config": 80, "model": 60, "data": 40, "record": 25, "registry": 35, "checkpoint": 25, "output": 15}
COUNTS |= {"gguf": 25, "prompts": 25, "resume": 20}


def cases(seed: int = 49) -> list[tuple[str, Builder]]:
    """Each case draws from its own generator (seed, class, index): the same case whichever others run."""
    return [(name, CLASSES[name](random.Random(f"{seed}/{name}/{i}"))) for name, n in COUNTS.items() for i in range(n)]


# ---- round four (issue 68): special files, sniffed data, garbage weights, injected settings --------------------

SPECIAL_KINDS = ("fifo", "zero", "null", "loop")
SPECIAL_WORDS = {
    "fifo": r"is a FIFO \(a named pipe\)",
    "zero": r"is a character device",
    "null": r"is a character device",
    "loop": r"is a symlink loop",
}


def _special(d: Path, kind: str, name: str) -> Path:
    """A path that is no regular file: a FIFO (which a reader would wait on forever), /dev/zero (endless),
    /dev/null, or a symlink loop, named `name` in d where it is made there."""
    if kind == "zero":
        return Path("/dev/zero")
    if kind == "null":
        return Path("/dev/null")
    p = d / name
    if kind == "fifo":
        import os

        os.mkfifo(p)
    else:
        other = d / f"{name}.other"
        p.symlink_to(other)
        other.symlink_to(p)
    return p


def special_case(rng: random.Random) -> Builder:
    """A FIFO, a device or a symlink loop where a reader expects a file (or a run directory): every reader
    names what it found, in one line, without opening it."""
    kind = rng.choice(SPECIAL_KINDS)
    reader = rng.choice(
        [
            "model",
            "model-json",
            "model-gguf",
            "config",
            "data",
            "advise-data",
            "prompts",
            "registry",
            "export",
            "resume",
        ]
    )

    def build(d: Path) -> tuple[list[str], str]:
        words = SPECIAL_WORDS[kind]
        suffix = {"model-json": ".json", "model-gguf": ".gguf", "config": ".toml", "data": ".jsonl"}.get(reader, "")
        p = _special(d, kind, f"thing{suffix}")
        if reader.startswith("model"):
            command = rng.choice([["plan", "--model"], ["trace", "--model"], ["advise", "--registry", "off"]])
            return [*command, str(p), "--gpus", "cpu"], rf"^model\.source: '.*' {words}"
        if reader == "config":
            command = rng.choice([["plan"], ["trace"], ["train"], ["launch", "--target", "torchrun"]])
            return [*command, str(p)], rf"^config: '.*' {words}"
        if reader == "data":
            (d / "tiny.json").write_text(json.dumps(TINY))
            argv = ["train", "--model", str(d / "tiny.json"), "--set", "model.init=random", "--seq", "32"]
            return [*argv, "--set", f"data.source={p}", "--output-dir", str(d / "out")], rf"^data\.source: '.*' {words}"
        if reader == "advise-data":
            return [
                "advise",
                "GPT-2",
                "--registry",
                "off",
                "--data",
                str(p),
                "--out",
                "x.toml",
            ], rf"^--data: '.*' {words}"
        if reader == "prompts":
            return ["generate", "default", "--prompts", str(p)], rf"^--prompts: '.*' {words}"
        if reader == "registry":
            action = rng.choice([["list"], ["show", "1"], ["compare", "1", "2"]])
            return ["runs", *action, "--registry", str(p)], rf"^--registry: '.*' {words}"
        if reader == "export":
            return ["export", str(p), "-o", str(d / "exported")], rf"^RUN_OR_CHECKPOINT: '.*' {words}"
        (d / "tiny.json").write_text(json.dumps(TINY))
        argv = ["train", "--model", str(d / "tiny.json"), "--set", "model.init=random", "--seq", "32"]
        return [*argv, "--set", f"checkpoint.resume={p}", "--output-dir", str(d / "out")], (
            rf"^checkpoint\.resume: '.*' {words}, not a checkpoint directory"
        )

    return build


def sniffed_case(rng: random.Random) -> Builder:
    """advise --data (which writes a config naming the data) given data that train refuses: the same reader
    runs, so the same row is named, before --out is written."""
    kind = rng.choice(["messages-string", "messages-empty", "empty-dir", "blank-rows", "null-row", "text-number"])

    def build(d: Path) -> tuple[list[str], str]:
        f = d / "data.jsonl"
        n = rng.randrange(1, 5)
        good = [json.dumps({"text": f"row {i}"}) for i in range(n)]
        pattern = r"^--data: "
        if kind == "messages-string":
            f.write_text("\n".join([json.dumps({"messages": "hello " * rng.randrange(1, 9)})] * n) + "\n")
            pattern = r"^--data: data\.jsonl:1: messages must be a non-empty list"
        elif kind == "messages-empty":
            f.write_text("\n".join([json.dumps({"messages": []})] * n) + "\n")
            pattern = r"^--data: data\.jsonl:1: messages must be a non-empty list"
        elif kind == "empty-dir":
            f = d / "data"
            f.mkdir()
            pattern = r"^--data: '.*data' holds no non-empty document"
        elif kind == "blank-rows":
            f.write_text("\n".join([json.dumps({"text": " " * rng.randrange(0, 5)})] * n) + "\n")
            pattern = r"^--data: '.*data\.jsonl' holds no non-empty document"
        elif kind == "null-row":
            rows = [*good]
            rows.insert(rng.randrange(n + 1), "null")
            f.write_text("\n".join(rows) + "\n")
            pattern = r"^--data: data\.jsonl:\d+: is not a JSON object \(null\)"
        else:
            f.write_text("\n".join([json.dumps({"text": rng.randrange(10**6)})] * n) + "\n")
        return ["advise", "GPT-2", "--registry", "off", "--gpus", "cpu", "--data", str(f), "--out", "x.toml"], pattern

    return build


def _safetensors(entries: dict, data: bytes) -> bytes:
    head = json.dumps(entries).encode()
    return len(head).to_bytes(8, "little") + head + data


def weights_case(rng: random.Random) -> Builder:
    """A run whose result/ weights are not what they say (random bytes, a header that lies about its length,
    a tensor whose bytes do not match its shape, an unknown dtype, a file cut short): export refuses it and
    writes nothing."""
    kind = rng.choice(["bytes", "header-length", "shape", "dtype", "cut", "empty"])

    def build(d: Path) -> tuple[list[str], str]:
        run = d / "run"
        result = run / "result"
        result.mkdir(parents=True)
        (result / "config.json").write_text(json.dumps(TINY))
        f = result / "model.safetensors"
        n = rng.randrange(1, 64)
        good = {"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}
        if kind == "bytes":
            f.write_bytes(_garbage(rng, rng.randrange(1, 4000)))
        elif kind == "header-length":
            f.write_bytes((10**12).to_bytes(8, "little") + b"{}" + bytes(8))
        elif kind == "shape":
            wrong = {"w": {"dtype": "F32", "shape": [n, 2], "data_offsets": [0, 4 * n]}}
            f.write_bytes(_safetensors(wrong, bytes(4 * n)))
        elif kind == "dtype":
            wrong = {
                "w": {"dtype": rng.choice(["F128", "Q4", "", "float32"]), "shape": [n], "data_offsets": [0, 4 * n]}
            }
            f.write_bytes(_safetensors(wrong, bytes(4 * n)))
        elif kind == "cut":
            f.write_bytes(_safetensors(good, bytes(4 * n))[: -rng.randrange(1, 4 * n + 1)])
        else:
            f.write_bytes(b"")
        (run / "record.json").write_text(json.dumps({"config": {"mode": "full", "model": {"source": "x"}}}))
        return ["export", str(run), "-o", str(d / "exported")], (
            r"^RUN_OR_CHECKPOINT: '.*model\.safetensors' is not a safetensors file trainplan can stand behind"
        )

    return build


def settings_case(rng: random.Random) -> Builder:
    """A --set that would set more than its one key (a line break), a module name that is empty or padded,
    and the figures past any run: --tokens, accept's --perturb-plan factor."""
    kind = rng.choice(["newline", "carriage", "empty-module", "padded-module", "tokens", "perturb"])
    command = rng.choice([["plan"], ["trace"], ["advise", "GPT-2", "--registry", "off"]])

    def build(d: Path) -> tuple[list[str], str]:
        if kind in ("newline", "carriage"):
            brk = "\n" if kind == "newline" else rng.choice(["\r", "\r\n"])
            key = rng.choice(["optim.lr=1e-4", "lora.r=8", 'precision="fp32"'])
            extra = rng.choice(['mode="full"', "batch.seq_len=64", "[train]", 'hardware.gpus="cpu"'])
            return [
                *command,
                "--set",
                f"{key}{brk}{extra}",
            ], rf"^{re.escape(key.split('=')[0])}: the --set .* holds a control character \(a line break\)"
        if kind == "empty-module":
            blank = rng.choice(['""', '" "', '"\\t"'])
            return [*command, "--mode", "lora", "--set", f'lora.target_modules=["q_proj", {blank}]'], (
                r"^lora\.target_modules: holds an empty module name"
            )
        if kind == "padded-module":
            name = rng.choice(['" q_proj"', '"v_proj "'])
            return [*command, "--mode", "lora", "--set", f"lora.target_modules=[{name}]"], (
                r"^lora\.target_modules: holds a padded module name"
            )
        if kind == "tokens":
            n = 10 ** rng.randrange(16, 40) + rng.randrange(10**6)
            return [
                "advise",
                "GPT-2",
                "--registry",
                "off",
                "--tokens",
                str(n),
            ], r"^--tokens: .* is past any training run"
        factor = rng.choice(["nan", "inf", "-inf", "-1", "0", "-0.5", "1e9", "NaN"])
        return ["accept", "--perturb-plan", f"activations={factor}", "--output-dir", str(d / "acc")], (
            r"^--perturb-plan: factor .* must be a number above 0"
        )

    return build


def gguf_version_case(rng: random.Random) -> Builder:
    """A GGUF whose version this reader does not know (0, 1, 4 and past, a big-endian file's byte-swapped 3):
    refused with the version found, never read as if it were 3."""
    version = rng.choice([0, 1, 4, 5, 99, 2**31, 0x03000000])

    def build(d: Path) -> tuple[list[str], str]:
        f = d / "model.gguf"
        f.write_bytes(b"GGUF" + version.to_bytes(4, "little") + bytes(rng.randrange(16, 64)))
        command = rng.choice([["plan", "--model"], ["trace", "--model"], ["advise", "--registry", "off"]])
        return [*command, str(f), "--gpus", "cpu"], rf"^model\.source: .*GGUF version {version} is not one"

    return build


def output_path_case(rng: random.Random) -> Builder:
    """An output that cannot be written: the error names the path the user gave, never the temporary sibling
    the atomic write goes through."""
    where = rng.choice(["proc", "sys", "under-a-file"])
    command = rng.choice(
        [["plan", "--model", "GPT-2", "--gpus", "cpu", "-o"], ["advise", "GPT-2", "--registry", "off", "--out"]]
    )

    def build(d: Path) -> tuple[list[str], str]:
        name = f"x{rng.randrange(1000)}.{'json' if command[0] == 'plan' else 'toml'}"
        if where == "under-a-file":
            (d / "afile").write_text("x")
            target = d / "afile" / name
        else:
            target = Path(f"/{where}") / name
        flag = "--output" if command[0] == "plan" else "--out"
        return [*command, str(target)], rf"^{flag}: cannot write '{re.escape(str(target))}' \("

    return build


CLASSES |= {
    "special": special_case,
    "sniffed": sniffed_case,
    "weights": weights_case,
    "settings": settings_case,
    "gguf-version": gguf_version_case,
    "output-path": output_path_case,
}
ROUND_FOUR = ("special", "sniffed", "weights", "settings", "gguf-version", "output-path")
COUNTS |= {"special": 30, "sniffed": 15, "weights": 12, "settings": 18, "gguf-version": 8, "output-path": 8}
