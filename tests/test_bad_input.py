"""Every bad input: exit 2, one line on stderr naming the field and the fix, no traceback, nothing
on stdout, nothing written. In-process through `cli.main` (each case takes milliseconds); the
table is generated per config field (wrong types, non-finite numbers) and listed by hand for
ranges, files, outputs and each command's own flags."""

from __future__ import annotations

import dataclasses
import os

import pytest

from trainplan import cli
from trainplan import config as C

# A wrong-typed value for each declared type (TOML literals, as --set reads them).
WRONG = {"int": '"lots"', "float": '"lots"', "bool": '"maybe"', "str": "5", "list[str]": '"q_proj"'}


def _fields():
    """(section, field, its one type); fields of several types (memory.activation_checkpointing:
    bool | int | str) have their own bad-value tests (tests/run/test_checkpointing.py)."""
    for section, cls in C._SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            kinds = [k.strip() for k in str(f.type).split("|") if k.strip() != "None"]
            if len(kinds) == 1:
                yield section, f.name, kinds[0]


TYPE_CASES = [
    (["plan", "--set", f"{s}.{n}={WRONG[t]}"], rf"^{s}\.{n}: must be ") for s, n, t in _fields() if t in WRONG
] + [
    (["plan", "--set", "mode=5"], r"^run\.mode: must be a string"),
    (["plan", "--set", "run=5"], r"^run: unknown setting"),
]

NONFINITE_CASES = [
    (["plan", "--set", f"{s}.{n}={v}"], rf"^{s}\.{n}: must be a finite number")
    for s, n, t in _fields()
    if t == "float"
    for v in ("nan", "inf", "-inf")
]

RANGE_CASES = [
    (["plan", "--set", item], rf"^(run[.])?{item.split('=')[0].replace('.', '[.]')}: ")
    for item in [
        "optim.lr=0",
        "optim.lr=-1e-4",
        "optim.weight_decay=-1",
        "train.max_grad_norm=-1",
        "train.steps=0",
        "train.seed=-1",
        "train.warmup_steps=-1",
        "train.eval_every=-1",
        "train.eval_batches=-1",
        "train.stop_after=-1",
        "train.overfit_batches=-1",
        "train.loss_chunk_tokens=0",
        "checkpoint.every=-1",
        "checkpoint.keep_last=0",
        "lora.r=0",
        "lora.alpha=0",
        "lora.dropout=1",
        "lora.dropout=-0.1",
        "lora.target_modules=[]",
        "data.eval_fraction=0",
        "data.eval_fraction=1",
        "data.eval_fraction=-0.5",
        "guard.window=1",
        "guard.threshold=0",
        "guard.threshold=-3",
        "guard.min_history=-1",
        "guard.min_loss_scale=0",
        "guard.rollback_skip=-1",
        "guard.rollback_lr_factor=0",
        "guard.max_rollbacks=-1",
        "guard.on_spike=explode",
        "guard.on_nonfinite=ignore",
        "hardware.allocator_reserve=-0.1",
        "hardware.allocator_reserve=1",
        "hardware.safety_margin=1",
        "hardware.cuda_context_mib=-1",
        "hardware.cublas_workspace_mib=-1",
        "hardware.cpu_runtime_mib=-1",
        "batch.seq_len=0",
        "batch.micro_batch_size=0",
        "batch.grad_accum_steps=0",
        "batch.global_batch_size=0",
        "parallel.tp=0",
        "parallel.pp=0",
        "parallel.cp=0",
        "parallel.strategy=zero4",
        "memory.attention=flash9",
        "optim.name=adam",
        "optim.implementation=turbo",
        "model.init=pretend",
        "model.source=",
        "train.schedule=linear",
        "precision=fp8",
        "mode=pretrain",
    ]
]

FLAG_CASES = [
    (["plan", "--seq", "0"], r"^batch\.seq_len: must be an integer >= 1"),
    (["plan", "--micro-batch", "-2"], r"^batch\.micro_batch_size: must be an integer >= 1"),
    (["plan", "--gpus", "4090"], r"^hardware\.gpus: .*RTX4090"),
    (["plan", "--gpus", "H1000"], r"^hardware\.gpus: unknown device 'H1000'"),
    (["plan", "--gpus", "99999999999xH100-80GB"], r"^hardware\.gpus: "),
    (["plan", "--gpus", "0xH100-80GB"], r"^hardware\.gpus: "),
    (["plan", "--gpus", "-2xH100-80GB"], r"^argument --gpus: expected one argument; see trainplan plan --help"),
    (["plan", "--gpus=-2xH100-80GB"], r"^hardware\.gpus: "),
    (["plan", "--seq", "many"], r"^argument --seq: invalid int value"),
    (["plan", "--no-such-flag"], r"^unrecognized arguments"),
    (["nosuchcommand"], r"^argument COMMAND: invalid choice"),
    (["plan", "--gpus", ""], r"^hardware\.gpus: "),
    (["plan", "--gpus", "2x"], r"^hardware\.gpus: "),
    (["plan", "--gpu-mem", "lots"], r"^hardware\.gpu_mem: "),
    (["plan", "--gpu-mem=-24GiB"], r"^hardware\.gpu_mem: "),
    (["plan", "--gpu-mem", "24"], r"^hardware\.gpu_mem: "),
    (["plan", "--model", "Llama-3.1-8C"], r"^model\.source: unknown preset 'Llama-3.1-8C'"),
    (["plan", "--mode", "lorra"], r"^run\.mode: unknown value 'lorra'"),
    (["plan", "--set", "batch.seqlen=4"], r"^batch\.seqlen: unknown setting; did you mean 'batch\.seq_len'"),
    (["plan", "--set", "nosuchsection.x=1"], r"^nosuchsection\.x: unknown setting"),
    (["plan", "--set", "batch.seq_len"], r"^--set: 'batch\.seq_len' is not key=value"),
    (["plan", "--gpus", "3xH100-80GB", "--tp", "2"], r"^parallel\.tp: tp 2 x pp 1 = 2 does not divide"),
    (["plan", "--model", "GPT-2", "--gpus", "16xA100-80GB", "--pp", "16"], r"^parallel\.pp: 16 pipeline stages"),
    # context parallelism (issue 67): heads, world, sequence, attention and layouts it does not compose with
    (["plan", "--model", "Qwen2.5-0.5B", "--gpus", "8xH100-80GB", "--cp", "8"], r"^parallel\.cp: cp 8 does not share"),
    (["plan", "--gpus", "3xH100-80GB", "--cp", "2"], r"^parallel\.cp: cp 2 does not divide the world size 3"),
    (
        ["plan", "--model", "Llama-3.1-8B", "--gpus", "2xH100-80GB", "--cp", "2", "--seq", "4095"],
        r"^batch\.seq_len: 4095 tokens do not split",
    ),
    (
        ["plan", "--model", "Llama-3.1-8B", "--gpus", "2xH100-80GB", "--cp", "2", "--attention", "eager"],
        r"^memory\.attention: context par",
    ),
    (
        ["plan", "--model", "Llama-3.1-8B", "--gpus", "4xH100-80GB", "--cp", "2", "--tp", "2"],
        r"^parallel\.cp: context parallelism beside",
    ),
    (["train", "--gpus", "cpu", "--cp", "2"], r"^parallel\.cp: cp 2 does not divide the world size 1"),
    # the tiled MLP where it cannot tile, and where nothing is saved to tile
    (
        ["plan", "--model", "Mixtral-8x7B", "--gpus", "8xH100-80GB", "--set", "memory.tiled_mlp=true"],
        r"^memory\.tiled_mlp: mixtral's MLP is a mixture",
    ),
    (["plan", "--mode", "inference", "--set", "memory.tiled_mlp=true"], r"^memory\.tiled_mlp: inference saves nothing"),
    (["plan", "--set", "memory.tiled_mlp=3"], r"^memory\.tiled_mlp: must be true or false"),
    (["plan", "--gpus", "cpu", "--global-batch", "3", "--micro-batch", "2"], r"^batch\.global_batch_size: 3 is not"),
    (["plan", "--mode", "qlora", "--gpus", "cpu"], r"^run\.mode: qlora needs CUDA GPUs"),
    (["plan", "--model", "GPT-2", "--seq", "100000000"], r"^batch\.seq_len: "),
    (["trace", "--model", "GPT-2", "--seq", "100000000"], r"^batch\.seq_len: "),
    (["plan", "--model", "Llama-3.2-1B", "--seq", "1000000"], r"^batch\.seq_len: 1000000 exceeds the model's context"),
    (["trace", "--model", "Llama-3.2-1B", "--seq", "100000000"], r"^batch\.seq_len: 100000000 exceeds the model's"),
    (["advise", "Qwen2.5-0.5B", "--gpus", "cpu", "--seq", "1000000"], r"^batch\.seq_len: 1000000 exceeds the"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--mode", "fast"], r"^--mode: unknown value 'fast'"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--prefer", "cheap"], r"^--prefer: unknown value"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--format", "xml"], r"^--format: unknown value"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--margin", "0.95"], r"^--margin: must be in"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--margin", "nan"], r"^--margin: must be in"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--top", "-1"], r"^--top: must be >= 0"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--global-batch", "0"], r"^--global-batch: must be"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--tokens", "0"], r"^--tokens: must be >= 1"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--epochs", "0"], r"^--epochs: must be a number > 0"),
    (["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--epochs", "inf"], r"^--epochs: must be a number > 0"),
    (["advise", "Nope-1B", "--gpus", "8xH100-80GB"], r"^model\.source: unknown preset 'Nope-1B'"),
    (["advise", "Llama-3.1-8B", "--gpus", "4090"], r"^hardware\.gpus: "),
    (["accept", "--tolerance", "-1"], r"^--tolerance: "),
    (["accept", "--tolerance", "nan"], r"^--tolerance: "),
    (["accept", "--tolerance", "2"], r"^--tolerance: "),
    (["accept", "--nproc", "0"], r"^--nproc: "),
    (["accept", "--nproc", "-3"], r"^--nproc: "),
    (["accept", "--resume-steps", "0"], r"^--resume-steps: must be >= 2"),
    (["accept", "--resume-steps", "4", "--resume-at", "9"], r"^--resume-at: "),
    (["accept", "--overfit-steps", "0"], r"^--overfit-steps: "),
    (["accept", "--perturb-plan", "nonsense=2"], r"^--perturb-plan: "),
    (["accept", "--perturb-plan", "weights"], r"^--perturb-plan: "),
    (["accept", "--set", "optim.lr=inf"], r"^optim\.lr: must be a finite number"),
    (["accept", "--set", "train.max_grad_norm=nan"], r"^train\.max_grad_norm: must be a finite number"),
    (["verify-resume", "--set", "optim.lr=nan"], r"^optim\.lr: must be a finite number"),
    (["verify-resume", "--nproc", "0"], r"^--nproc: must be between 1 and"),
    (["verify-resume", "--tolerance", "nan"], r"^--tolerance: must be a finite number >= 0"),
    (["verify-resume", "--tolerance", "-1"], r"^--tolerance: must be a finite number >= 0"),
    (["verify-resume", "--steps", "1"], r"^--steps: must be >= 2"),
    (["verify-resume", "--steps", "6", "--at", "6"], r"^--at: must be between 1 and 5"),
    (["train", "--set", "checkpoint.resume=auto"], r'^checkpoint\.resume: "auto" looks in the run\'s own directory'),
    (["train", "--steps", "0"], r"^train\.steps: must be an integer >= 1"),
    (["train", "--set", "guard.threshold=nan"], r"^guard\.threshold: must be a finite number"),
    (["train", "--set", 'lora.target_modules="q_proj"', "--mode", "lora"], r"^lora\.target_modules: must be a list"),
    (["train", "--set", "optim.lr=inf"], r"^optim\.lr: must be a finite number"),
    (["train", "--set", "train.output_dir=5"], r"^train\.output_dir: must be a string"),
    (["train", "--gpus", "4090"], r"^hardware\.gpus: "),
    (["train", "--model", "Llama-3.1-8B"], r"^model\.source: 'Llama-3.1-8B' describes an architecture"),
    (["train", "--set", "data.source=/nonexistent/corpus.jsonl"], r"^data\.source: "),
    (["runs", "show", "999999"], r"^(registry: no run registry at |runs: no run 999999 in )"),
    (["runs", "show", "abc"], r"^argument ids: invalid int value: 'abc'"),
    (["runs", "compare", "1"], r"^runs compare: takes 2 run id\(s\), got 1"),
    (["devices", "--gpus", "0,zz"], r"^--gpus: "),
    (["ui", "--port", "abc"], r"^argument --port: invalid int value: 'abc'"),
    (["ui", "--port", "٣"], r"^argument --port: invalid int value: '٣'"),
    (["ui", "--port", "70000"], r"^--port: must be 0\.\.65535 \(got 70000\)"),
    # numbers in ASCII digits only (int() and `\d` would read these): steps, device counts, sizes, indices
    (["plan", "--set", 'guard.inject=["nan-loss@²"]'], r"^guard\.inject: 'nan-loss@²' is not KIND@STEP"),
    (["plan", "--set", 'guard.inject=["spike@٣"]'], r"^guard\.inject: 'spike@٣' is not KIND@STEP"),
    (["plan", "--seq", "٣"], r"^argument --seq: invalid int value: '٣'"),
    (["plan", "--micro-batch", "１"], r"^argument --micro-batch: invalid int value"),
    (["plan", "--gpus", "٢xH100-80GB"], r"^hardware\.gpus: unknown device '٢xH100-80GB'"),
    (["plan", "--gpus", "２４GiB"], r"^hardware\.gpus: unknown device"),
    (["plan", "--gpu-mem", "٣GiB"], r"^hardware\.gpu_mem: unknown device '٣GiB'"),
    (["plan", "--gpus", "cpu", "--set", "hardware.host_mem=٣GiB"], r"^hardware\.host_mem: cannot read size"),
    (["plan", "--gpus", "cpu", "--set", f"hardware.host_mem={'9' * 30}GiB"], r"^hardware\.host_mem: size .* past any"),
    (["plan", "--gpus", "cpu", "--set", "hardware.memory_budget=1e3GiB"], r"^hardware\.memory_budget: cannot read"),
    (["devices", "--gpus", "٣"], r"^--gpus: '٣' is not a list of GPU indices"),
    (["accept", "--perturb-plan", "activations=٣"], r"^--perturb-plan: "),
    (
        ["advise", "Llama-3.1-8B", "--gpus", "8xH100-80GB", "--margin", "٠.١"],
        r"^argument --margin: invalid float value",
    ),
    (["generate", "/nonexistent/model", "--prompt", "hi"], r"^MODEL: no such model directory or file"),
    (["generate", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "0"], r"^--max-new-tokens: must be 1\.\.4096"),
    (["generate", "tiny-llama", "--prompt", "hi", "--temperature", "-1"], r"^--temperature: must be >= 0"),
    (["settings", "--set", "optim.lr=nan"], r"^optim\.lr: must be a finite number"),
    (["config", "--show", "/nonexistent.toml"], r"^config: no such file '/nonexistent\.toml'"),
    (["export", "/nonexistent/run", "-o", "out"], r"^RUN_OR_CHECKPOINT: no such directory '/nonexistent/run'"),
    (["launch", "/nonexistent.toml", "--target", "slurm"], r"^config: no such file '/nonexistent\.toml'"),
    (["launch", "--target", "slurm"], r"^hardware\.gpus: is 'auto' \(this machine's devices\)"),
]


def _file_cases(tmp):
    """Cases that need files; built in a temporary directory each test gets."""
    garbage = tmp / "garbage.toml"
    garbage.write_bytes(b"\xff\xfe\x00\x01binary\x00garbage")
    bad_toml = tmp / "bad.toml"
    bad_toml.write_text("[batch\nseq_len = 4\n")
    run_five = tmp / "run5.toml"
    run_five.write_text("run = 5\n")
    wrong_section = tmp / "section.toml"
    wrong_section.write_text("batch = 5\n")
    bad_json = tmp / "config.json"
    bad_json.write_text("{not json")
    list_json = tmp / "list.json"
    list_json.write_text("[1, 2, 3]")
    empty_json = tmp / "empty.json"
    empty_json.write_text("{}")
    binary_json = tmp / "binary.json"
    binary_json.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    gguf = tmp / "model.gguf"
    gguf.write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") + (2**62).to_bytes(8, "little")
    )
    not_gguf = tmp / "nope.gguf"
    not_gguf.write_bytes(b"this is not gguf at all")
    chat = tmp / "chat.jsonl"
    chat.write_text('{"messages": "hello there"}\n{"text": "more"}\n')
    binary_jsonl = tmp / "binary.jsonl"
    binary_jsonl.write_bytes(b'{"text": "\xff\xfe"}\n')
    tiny_corpus = tmp / "tiny"
    tiny_corpus.mkdir()
    for name in ("one.txt", "two.txt"):
        (tiny_corpus / name).write_text("a few words, " * 40)
    a_file = tmp / "a-file"
    a_file.write_text("x")
    a_dir = tmp / "a-dir"
    a_dir.mkdir()
    return [
        (["plan", str(garbage)], r"^config: '.*garbage\.toml' is UTF-16 text; save it as UTF-8"),  # its FF FE
        (["plan", str(bad_toml)], r"invalid TOML"),
        (["plan", str(run_five)], r"^run: must be a table"),
        (["plan", str(wrong_section)], r"^batch: is a section, not a setting"),
        (["plan", str(tmp / "missing.toml")], r"^config: no such file"),
        (["plan", str(a_dir)], r"^model\.source: .*has no config\.json"),  # a directory is a model
        (["plan", str(tmp / "no-such-model")], r"^config: .*neither a TOML file nor a model"),
        (["plan", "--model", str(bad_json)], r"^model\.source: .*malformed JSON"),
        (["plan", "--model", str(list_json)], r"^model\.source: "),
        (["plan", "--model", str(empty_json)], r"^model\.source: "),
        (["plan", "--model", str(binary_json)], r"^model\.source: "),
        (["plan", "--model", str(gguf)], r"^model\.source: "),
        (["plan", "--model", str(not_gguf)], r"^model\.source: "),
        (["plan", "--model", str(a_dir)], r"^model\.source: "),
        (["plan", "--model", str(tmp / "missing.gguf")], r"^model\.source: "),
        (["plan", "--json", "-o", str(a_file / "plan.json")], r"^--output: cannot write .*plan\.json"),
        (["plan", "--json", "-o", str(a_dir)], r"^--output: cannot write .*a-dir"),
        (["plan", "--json", "-o", "/proc/version"], r"^--output: cannot write '/proc/version'"),
        (["runs", "list", "--registry", str(garbage)], r"^--registry: .*garbage\.toml is not a readable trainplan"),
        (["runs", "list", "--registry", str(a_dir)], r"^--registry: .*a-dir' is a directory, not a run registry"),
        (["train", str(run_five)], r"^run: must be a table"),
        (["train", "--set", f"data.source={binary_json}"], r"^data\.source: .*binary\.json' is binary, not text"),
        (["train", "--set", f"train.output_dir={a_file}"], r"^train\.output_dir: "),
        (["train", "--set", f"checkpoint.dir={a_file / 'x'}"], r"^checkpoint\.dir: "),
        (["accept", "--output-dir", str(a_file)], r"^--output-dir: "),
        (["train", "--set", f"data.source={chat}"], r"^data\.source: chat\.jsonl:1: messages must be a non-empty"),
        (["train", "--set", f"data.source={binary_jsonl}"], r"^data\.source: .*binary\.jsonl' is not UTF-8 text"),
        (
            ["train", "--set", f"data.source={tiny_corpus}", "--seq", "8", "--micro-batch", "64"],
            r"^batch\.micro_batch_size: 64 per rank x 1 rank\(s\) needs 64 sequences at once",
        ),
        (
            ["train", "--set", f"data.source={tiny_corpus}", "--seq", "256", "--set", "data.eval_fraction=0.5"],
            r"^batch\.seq_len: 256 is longer than the training split \(data\.eval_fraction = 0\.5\)",
        ),
    ]


ALL = TYPE_CASES + NONFINITE_CASES + RANGE_CASES + FLAG_CASES


def test_the_table_is_large_enough():
    assert len(ALL) + len(_file_cases(_Tmp())) >= 150


def test_every_command_has_its_bad_input_cases():
    from trainplan.cli import COMMANDS

    assert set(COMMANDS) <= {argv[0] for argv, _ in ALL}, set(COMMANDS) - {argv[0] for argv, _ in ALL}


class _Tmp:  # a throwaway stand-in for counting the file cases
    def __truediv__(self, name):
        return self

    def write_text(self, *_):
        pass

    def write_bytes(self, *_):
        pass

    def mkdir(self, *_):
        pass


def _check(argv, pattern, tmp_path, capsys, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code = cli.main(argv + (["--registry", "off"] if argv[0] in ("train", "accept") else []))
    assert not os.path.exists(tmp_path / "runs"), "a run started: the input was not refused"
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    message = lines[0].split(": error: ", 1)[-1]
    assert re.search(pattern, message), (pattern, message)
    assert out == ""
    assert sorted(os.listdir(tmp_path)) == before  # nothing half-written


@pytest.mark.parametrize(("argv", "pattern"), ALL, ids=[" ".join(a)[:80] for a, _ in ALL])
def test_bad_input_is_one_line_and_exit_2(argv, pattern, tmp_path, capsys, monkeypatch):
    _check(argv, pattern, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("case", range(28))
def test_bad_files_are_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    argv, pattern = _file_cases(files)[case]
    _check(argv, pattern, tmp_path, capsys, monkeypatch)


# Hostile `--set KEY=VALUE` text for every field: unicode digits, non-finite and huge numbers, empty
# values, nested tables and arrays, control and astral characters.
HOSTILE_VALUES = [
    "²",
    "٣",
    "１２",
    "3²",
    "nan",
    "inf",
    "-inf",
    "1e999",
    "9" * 400,
    "-" + "9" * 400,
    "",
    '""',
    "{a = 1}",
    "{nested = {deep = 1}}",
    "[[1]]",
    '[{a = "b"}]',
    '"\\u0000"',
    "😀",
]


def _every_key() -> list[tuple[str, str]]:
    """(key, its declared type) for every setting --set can name."""
    from trainplan.config.schema import _TOP_KEYS, RunConfig

    top = {f.name: str(f.type) for f in dataclasses.fields(RunConfig)}
    out = [(k, top[k]) for k in _TOP_KEYS]
    for section, cls in C._SECTION_TYPES.items():
        out += [(f"{section}.{f.name}", str(f.type)) for f in dataclasses.fields(cls)]
    return out


@pytest.mark.parametrize(("key", "kind"), _every_key(), ids=[k for k, _ in _every_key()])
def test_hostile_values_for_every_setting_are_bad_input_never_a_crash(key, kind, tmp_path, capsys, monkeypatch):
    """Every hostile value of every field: never an internal error (exit 4). A field that is not a plain
    string refuses them all (exit 2, one line naming the field); a string field may accept a string."""
    monkeypatch.chdir(tmp_path)
    base = {"model.source": ["--model", "tiny-llama"], "hardware.gpus": ["--gpus", "cpu"]}
    fixed = [x for k, flags in base.items() if k != key for x in flags]
    for raw in HOSTILE_VALUES:
        code = cli.main(["plan", *fixed, "--set", f"{key}={raw}"])
        out, err = capsys.readouterr()
        assert code in (0, 1, 2), (key, raw, code, err[-2000:])
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in err, (key, raw, err[-2000:])
        elif kind.replace(" | None", "") != "str" or not _is_string(raw):
            pytest.fail(f"{key}={raw!r} was accepted (exit {code}); it is no value of {kind}")


def _is_string(raw: str) -> bool:
    """Whether --set reads `raw` as a string (a bare word, or a quoted TOML string)."""
    from trainplan.config.loading import parse_override

    return isinstance(parse_override(f"k={raw}")[1], str)
