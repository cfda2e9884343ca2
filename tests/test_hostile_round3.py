"""Bad input, round three (issue 46): sizes that are not sizes, config paths that are not files,
encodings, keys at the wrong level, unknown names and plan's flags given to advise. Each is exit 2,
one line naming the field, nothing on stdout, nothing written, across the commands that read it.
In-process through `cli.main`; the checks are test_bad_input.py's own."""

from __future__ import annotations

import pytest

from tests.test_bad_input import _check

SIZES = ["nanGiB", "NaN", "-5GiB", "inf", "infGiB", "1e400GB"]
SIZE_CASES = [
    ([command, *pre, f"{flag}={size}"], rf"^hardware\.{field}: '{size}' is not a size; give a positive, finite number")
    for command, pre in (("plan", []), ("trace", []), ("advise", ["Llama-3.2-1B"]))
    for flag, field in (("--gpus", "gpus"), ("--gpu-mem", "gpu_mem"))
    for size in SIZES
] + [
    ([command, *pre, f"--gpus={size}", *post], rf"^hardware\.gpus: '{size}' is not a size")
    for command, pre, post in (
        ("train", [], []),
        ("accept", [], ["--output-dir", "acc"]),
        ("launch", [], ["--target", "torchrun", "--set", 'train.output_dir="/shared/x"']),
    )
    for size in ("nanGiB", "-5GiB", "inf")
]


def _path_kinds(tmp):
    """name -> (path, the message's pattern): each way a config path can fail, made in tmp."""
    (tmp / "dir.toml").mkdir()
    (tmp / "dangling.toml").symlink_to(tmp / "nowhere")
    (tmp / "loop-a.toml").symlink_to(tmp / "loop-b.toml")
    (tmp / "loop-b.toml").symlink_to(tmp / "loop-a.toml")
    (tmp / "utf16.toml").write_bytes("mode = 'lora'\n".encode("utf-16"))
    (tmp / "latin1.toml").write_bytes(b'mode = "l\xe9ra"\n')
    return {
        "directory": (tmp / "dir.toml", r"^config: '.*dir\.toml' is a directory"),
        "dangling": (tmp / "dangling.toml", r"^config: '.*dangling\.toml' is a symlink to nothing"),
        "loop": (tmp / "loop-a.toml", r"^config: '.*loop-a\.toml' is a symlink loop"),
        "utf16": (tmp / "utf16.toml", r"^config: '.*utf16\.toml' is UTF-16 text; save it as UTF-8"),
        "latin1": (tmp / "latin1.toml", r"^config: '.*latin1\.toml' is not UTF-8 text"),
    }


PATH_COMMANDS = {
    "plan": [],
    "trace": [],
    "train": [],
    "accept": ["--output-dir", "acc"],
    "launch": ["--target", "slurm"],
}


@pytest.mark.parametrize("command", sorted(PATH_COMMANDS))
@pytest.mark.parametrize("kind", ["directory", "dangling", "loop", "utf16", "latin1"])
def test_a_config_path_that_is_not_a_toml_file_is_named_as_what_it_is(kind, command, tmp_path, capsys, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    path, pattern = _path_kinds(files)[kind]
    _check([command, str(path), *PATH_COMMANDS[command]], pattern, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("argv", [a for a, _ in SIZE_CASES], ids=[" ".join(a)[:60] for a, _ in SIZE_CASES])
def test_a_size_that_is_not_one_is_named_as_a_size(argv, tmp_path, capsys, monkeypatch):
    pattern = dict((tuple(a), p) for a, p in SIZE_CASES)[tuple(argv)]
    _check(list(argv), pattern, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("command", ["plan", "trace", "train", "accept"])
@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("micro_batch_size = 2\n", r"^micro_batch_size: belongs in the \[batch\] section; write it as batch\."),
        ("batch = 2\n", r"^batch: is a section, not a setting; give its settings, e.g\. batch\."),
        ("lr = 0.1\n", r"^lr: belongs in the \[optim\] section"),
    ],
)
def test_a_key_at_the_wrong_level_is_answered_with_its_section(command, text, pattern, tmp_path, capsys, monkeypatch):
    config = tmp_path / "files" / "level.toml"
    config.parent.mkdir()
    config.write_text(text)
    extra = ["--output-dir", "acc"] if command == "accept" else []
    _check([command, str(config), *extra], pattern, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("command", ["plan", "trace", "advise"])
def test_an_unknown_model_names_at_most_five_neighbours(command, tmp_path, capsys, monkeypatch):
    argv = [command, "NoSuchModel-9B"] if command == "advise" else [command, "--model", "NoSuchModel-9B"]
    _check(argv, r"^model\.source: unknown preset 'NoSuchModel-9B'; (did you mean|the closest of \d+ are)", tmp_path,
           capsys, monkeypatch)  # fmt: skip


def test_an_unknown_models_line_is_short(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from trainplan import cli

    assert cli.main(["plan", "--model", "zzzzzz"]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line) < 250 and line.count(",") <= 4, line


@pytest.mark.parametrize("flag", ["--micro-batch", "--grad-accum"])
def test_advise_refuses_plans_batch_flags_with_the_fix(flag, tmp_path, capsys, monkeypatch):
    _check(["advise", "Llama-3.2-1B", flag, "2"], rf"^{flag}: advise searches .* --global-batch N", tmp_path, capsys,
           monkeypatch)  # fmt: skip


def test_a_utf8_byte_order_mark_is_read_as_text(tmp_path, capsys):
    from trainplan import cli

    config = tmp_path / "bom.toml"
    config.write_bytes(b'\xef\xbb\xbfmode = "lora"\n[batch]\nseq_len = 64\n')
    assert cli.main(["plan", str(config), "--gpus", "H100-80GB", "--json"]) == 0
    assert '"seq_len": 64' in capsys.readouterr().out


ARCHITECTURES = {
    "unknown": (
        "nosucharch",
        r"model_type 'nosucharch' is not an architecture transformers [\d.]+ knows; did you mean",
    ),
    "upper-case": (
        "LLAMA",
        r"model_type 'LLAMA' is not an architecture transformers [\d.]+ knows; did you mean 'llama'",
    ),
    "encoder": ("bert", r"model_type 'bert' is not a decoder-only causal LM"),
    "encoder-decoder": ("t5", r"model_type 't5' is not a decoder-only causal LM"),
}


@pytest.mark.parametrize("command", ["plan", "trace", "advise"])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_a_config_json_of_an_architecture_that_is_not_a_causal_lm_is_refused(
    kind, command, tmp_path, capsys, monkeypatch
):
    """A complete decoder-shaped config.json whose model_type transformers does not know (or knows as
    an encoder) was an internal KeyError; now exit 2 naming model_type and what is known."""
    import json

    model_type, pattern = ARCHITECTURES[kind]
    path = tmp_path / "files" / "config.json"
    path.parent.mkdir()
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    path.write_text(json.dumps({"model_type": model_type, "vocab_size": 100, **sizes}))
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "files" / "cache"))  # no derived fit from before
    argv = [command, str(path)] if command == "advise" else [command, "--model", str(path)]
    _check(argv, r"^model\.source: " + pattern, tmp_path, capsys, monkeypatch)


def _json_shapes(tmp):
    deep = '{"a":' * 10_000 + "1" + "}" * 10_000
    shapes = {
        "nulls.jsonl": ("null\nnull\n", r"nulls\.jsonl:1: is not a JSON object \(null\)"),
        "numbers.jsonl": ('{"text": "a"}\n5\n', r"numbers\.jsonl:2: is not a JSON object \(a JSON number\)"),
        "deep.jsonl": (f'{{"text": {deep}}}\n', r"deep\.jsonl:1: nested too deeply"),
        "deep.json": ("[" + '{"t":' * 40 + '"x"' + "}" * 40 + "]", r"deep\.json row 1: nested too deeply"),
        "nulls.json": ("[null]", r"nulls\.json row 1: is not a JSON object \(null\)"),
    }
    for name, (text, _) in shapes.items():
        (tmp / name).write_text(text)
    return {name: (tmp / name, pattern) for name, (_, pattern) in shapes.items()}


@pytest.mark.parametrize("shape", ["nulls.jsonl", "numbers.jsonl", "deep.jsonl", "deep.json", "nulls.json"])
def test_data_that_crashed_pyarrow_is_refused_in_python(shape, tmp_path, capsys, monkeypatch):
    """JSON `null` rows and a 10,000-deep object ended the process with SIGSEGV inside `datasets`
    (pyarrow's JSON reader); checked in Python first, they are one line and exit 2."""
    files = tmp_path / "files"
    files.mkdir()
    path, pattern = _json_shapes(files)[shape]
    out = tmp_path / "files" / "out"
    _check(["train", "--data", str(path), "--steps", "1", "--output-dir", str(out)], r"^data\.source: " + pattern,
           tmp_path, capsys, monkeypatch)  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize("command", ["plan", "trace", "train", "accept"])
@pytest.mark.parametrize("where", ["toml", "set", "config.json"])
def test_input_nested_thousands_deep_is_bad_input_not_a_recursion_error(where, command, tmp_path, capsys, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    extra = ["--output-dir", "acc"] if command == "accept" else []
    if where == "toml":
        (files / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
        argv, pattern = [command, str(files / "deep.toml")], r"^config: '.*deep\.toml' is nested too deeply"
    elif where == "set":
        argv, pattern = [command, "--set", "a=" + "[" * 3000 + "]" * 3000], r"^--set: the value of 'a' is nested too"
    else:
        (files / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 10_000 + "]" * 10_000 + "}")
        argv = [command, "--model", str(files / "config.json")]
        pattern = r"^model\.source: .*config\.json is nested too deeply"
    _check([*argv, *extra], pattern, tmp_path, capsys, monkeypatch)
