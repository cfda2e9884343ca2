"""The real CLI, end to end, in subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan import cli
from trainplan.cli import named_command
from trainplan.commands import _common as common


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "trainplan", *args], capture_output=True, text=True, **kw)


@pytest.mark.multiprocess
def test_default_plan_runs_on_the_embedded_model():
    r = run("plan", "--gpus", "cpu")
    assert r.returncode == 0, r.stderr
    assert "SmolLM2-135M-Instruct (embedded default)" in r.stdout
    assert "full, fp32, micro-batch 1" in r.stdout  # precision "auto" on the CPU
    assert "FITS on every device" in r.stdout
    for row in ("weights", "optimizer", "activations", "logits_loss", "TOTAL (GiB)"):
        assert row in r.stdout
    r = run("plan", "--gpus", "cpu", "--precision", "amp-bf16")  # peaks in backward: the gradients' row
    assert r.returncode == 0 and "full, amp-bf16," in r.stdout and "gradients" in r.stdout, r.stderr


@pytest.mark.multiprocess
def test_json_schema_and_exit_code_for_does_not_fit():
    r = run("plan", "--model", "Llama-3.1-70B", "--gpus", "2xA100-80GB", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["schema"] == "trainplan.plan/1"
    assert doc["verdict"]["fits"] is False
    assert doc["verdict"]["overflows"][0]["device"] == "A100-80GB"
    dev = doc["devices"][0]
    assert set(dev["components"]) >= {"weights", "gradients", "optimizer", "activations", "runtime"}
    assert (
        dev["total_bytes"]
        == dev["peak_allocated_bytes"] + dev["components"]["runtime"] + dev["components"]["allocator_reserve"]
    )
    assert dev["phases"][dev["peak_phase"]]["total"] == dev["peak_allocated_bytes"]
    assert len(doc["devices"]) == 2


@pytest.mark.multiprocess
def test_markdown_output_to_file(tmp_path):
    out = tmp_path / "plan.md"
    r = run("plan", "--model", "Qwen2.5-0.5B", "--gpus", "L4", "--markdown", "--output", str(out))
    assert r.returncode == 0 and r.stdout == ""
    text = out.read_text()
    assert text.startswith("## trainplan plan: Qwen/Qwen2.5-0.5B") and "| weights |" in text


@pytest.mark.multiprocess
def test_the_analytic_path_imports_no_torch():
    code = (
        "import sys; from trainplan.cli import main; rc = main(['plan', '--gpus', 'cpu', '--json']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.multiprocess
def test_a_command_imports_its_own_module_and_no_other_command():
    """The command table is lazy (issue 47): `trainplan train` pays for no other command's imports
    (advise's search alone was 0.5 s of every launch's start-up)."""
    code = (
        "import sys; from trainplan.cli import build_parser, named_command; "
        "args = build_parser(named_command(sys.argv[1:])).parse_args(sys.argv[1:]); "
        "commands = [m for m in sys.modules if m.startswith('trainplan.commands.') and not m.endswith('_common')]; "
        "print(sorted(commands), 'trainplan.advise.search' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code, "train", "--set", "train.steps=2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['trainplan.commands.train']", "False"]
    assert named_command(["--version"]) is None and named_command(["tain"]) is None


BAD_INPUTS = [
    (["--model", "Llama-3.1-8C"], "model.source: unknown preset 'Llama-3.1-8C'; did you mean"),
    (["--seq", "0"], "batch.seq_len: must be an integer >= 1 (got 0)"),
    (["--micro-batch", "-2"], "batch.micro_batch_size: must be an integer >= 1 (got -2)"),
    (
        ["--model", "Llama-3.1-8B", "--gpus", "6xH100-80GB", "--tp", "3", "--pp", "2"],
        "parallel.tp: tp 3 does not divide the 32 attention heads",
    ),
    (
        ["--model", "GPT-2", "--gpus", "16xA100-80GB", "--pp", "16"],
        "parallel.pp: 16 pipeline stages exceed the 12 layers",
    ),
    (["--gpus", "3xH100-80GB", "--tp", "2"], "parallel.tp: tp 2 x pp 1 = 2 does not divide the world size 3"),
    (["--gpus", "H1000"], "hardware.gpus: unknown device 'H1000'; did you mean"),
    (["--mode", "lorra"], "run.mode: unknown value 'lorra'; did you mean 'lora'"),
    (["--set", "batch.seqlen=4"], "batch.seqlen: unknown setting; did you mean 'batch.seq_len'"),
    (["--gpus", "cpu", "--global-batch", "3", "--micro-batch", "2"], "batch.global_batch_size: 3 is not divisible"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS)
@pytest.mark.multiprocess
def test_bad_input_is_one_line_naming_field_and_fix(args, message, tmp_path):
    out = tmp_path / "plan.json"
    r = run("plan", *args, "--json", "--output", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.multiprocess
def test_malformed_config_json_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = run("plan", "--model", str(bad))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "malformed JSON" in r.stderr


def test_command_table_and_parser_agree():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)


def test_every_config_flag_maps_to_a_real_field():
    from trainplan import config as C

    for _, key, _ in common.CONFIG_FLAGS + tuple((f, k, {}) for f, k, _ in common.SWITCHES):
        C._set_dotted({}, key, 1)  # raises on an unknown key


@pytest.mark.parametrize("example", sorted(p.name for p in (Path(__file__).parent.parent / "examples").glob("*.toml")))
@pytest.mark.multiprocess
def test_shipped_examples_plan(example):
    path = Path(__file__).parent.parent / "examples" / example
    r = run("plan", str(path), "--json")
    assert r.returncode in (0, 1), r.stderr
    assert json.loads(r.stdout)["settings"]["mode"] in ("full", "lora", "qlora", "inference")


def test_flags_reach_verify_resume_runs_as_settings():
    from trainplan import config as C

    args = cli.build_parser().parse_args(
        [
            "verify-resume",
            "--mode",
            "lora",
            "--lora-targets",
            "q_proj,k_proj",
            "--checkpointing",
            "--seq",
            "64",
            "--set",
            "train.seed=3",
        ]
    )
    settings = common.settings_from_args(args)
    flags = [f"{k}={C.toml_literal(v)}" for k, v in settings.items()]
    cfg = C.load(None, flags + args.set)
    assert (
        cfg.mode,
        cfg.lora.target_modules,
        cfg.memory.activation_checkpointing,
        cfg.batch.seq_len,
        cfg.train.seed,
    ) == ("lora", ["q_proj", "k_proj"], True, 64, 3)


@pytest.mark.multiprocess
def test_verify_resume_refuses_k_outside_the_run():
    r = run("verify-resume", "--steps", "4", "--at", "4")
    assert r.returncode == 2 and "--at: must be between 1 and 3 (got 4)" in r.stderr


# The least each command needs to reach its own code (argparse's requirements met).
MINIMAL_ARGV = {
    "advise": ["Llama-3.1-8B"],
    "runs": ["list"],
    "export": ["run", "-o", "out"],
    "generate": ["tiny-llama", "--prompt", "hi"],
    "launch": ["job.toml", "--target", "slurm"],
}


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_an_unexpected_error_is_exit_4_in_one_line_and_its_traceback_is_kept(name, monkeypatch, capsys, tmp_path):
    """A bug is not bad input, nor a verdict: in every command, exit 4, one line naming the exception and a
    file with the traceback."""
    import re

    monkeypatch.setenv("HOME", str(tmp_path))  # tracebacks go under ~/.cache/trainplan/tracebacks

    def broken(args):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(cli.command(name), "run", broken)
    assert cli.main([name, *MINIMAL_ARGV.get(name, [])]) == 4
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"trainplan {name}: internal error: ZeroDivisionError: division by zero" in lines[0]
    saved = Path(re.search(r"traceback: (\S+);", lines[0]).group(1))
    assert saved.is_relative_to(tmp_path) and "raise ZeroDivisionError" in saved.read_text()


def test_every_help_and_the_readme_state_the_exit_codes(capsys):
    """One meaning per code, the same table everywhere: each --help ends with it, and the README's table
    lists the codes trainplan/errors.py defines."""
    from trainplan import errors

    for name in ["", *cli.COMMANDS]:
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([name, "--help"] if name else ["--help"])
        assert " ".join(capsys.readouterr().out.split()).endswith(errors.EXIT_CODES_HELP), name
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("### Exit codes", 1)[1].split("\n\n")[2]
    codes = [int(row.split("|")[1]) for row in table.splitlines()[2:]]
    defined = sorted(v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int))
    assert codes == defined == [0, 1, 2, 3, 4]


def test_a_sequence_beyond_the_context_is_refused_unless_extended(capsys):
    argv = ["plan", "--model", "Llama-3.2-1B", "--gpus", "H100-80GB", "--seq", "200000"]
    assert cli.main(argv) == 2
    assert "batch.seq_len: 200000 exceeds the model's context of 131072" in capsys.readouterr().err
    assert cli.main([*argv, "--set", "model.extend_context=true"]) in (0, 1)  # planned: fits or not
    assert "quality beyond it is not assured" in " ".join(capsys.readouterr().out.split())  # notes wrap


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_follow_the_umask(tmp_path, umask):
    """Reports are written atomically through a temporary file, whose 0600 must not stick."""
    import os

    old = os.umask(umask)
    try:
        assert cli.main(["plan", "--output", str(tmp_path / "plan.md")]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "plan.md").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_positional_model_is_the_model(tmp_path, capsys):
    """`plan Llama-3.1-8B` and `plan <config.json>` plan that model; a TOML file is still a config;
    a name that is neither says so, with the nearest presets and --model."""
    assert cli.main(["plan", "Llama-3.1-8B", "--mode", "lora", "--gpus", "H100-80GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "meta-llama/Llama-3.1-8B"
    (tmp_path / "run.toml").write_text('[model]\nsource = "GPT-2"\n')
    assert cli.main(["plan", str(tmp_path / "run.toml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "openai-community/gpt2"
    assert cli.main(["plan", "Lama-3.1-8B"]) == 2
    err = capsys.readouterr().err
    assert "neither a TOML file nor a model" in err and "'Llama-3.1-8B'" in err and "--model" in err
    assert cli.main(["plan", "Llama-3.1-8B", "--model", "GPT-2"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_a_reader_that_leaves_ends_the_output_quietly(monkeypatch, capsys):
    """`trainplan plan --markdown | head`: the pipe closes; no error line, no traceback, exit 141."""

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", Closed())
    assert cli.main(["plan", "--markdown"]) == 141
    assert capsys.readouterr().err == ""


def test_version(capsys):
    from trainplan import __version__

    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"trainplan {__version__}"


def test_settings_lists_every_key_and_each_default_round_trips(capsys):
    """`trainplan settings` names every config field; each default, written back with --set,
    loads to the default config (so the listing is the config, not a copy of it)."""
    from trainplan import config as C
    from trainplan.commands import settings

    assert cli.main(["settings", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    keys = [r["key"] for r in table]
    expected = list(C._TOP_KEYS) + [f"{s}.{f}" for s, cls in C._SECTION_TYPES.items() for f in cls.__dataclass_fields__]
    assert keys == expected
    sets = [f"{r['key']}={C.toml_literal(r['default'])}" for r in table if r["default"] is not None]
    assert C.load(None, sets) == C.RunConfig()
    flags = {r["key"]: r["flag"] for r in settings.rows()}
    assert flags["optim.lr"] == "--lr" and flags["lora.target_modules"] == "--lora-targets"


def test_config_show_gives_a_files_values_and_every_keys_meaning(capsys, tmp_path):
    """`trainplan config --show CONFIG`: the file's values beside the defaults, and a one-line
    meaning for every key, read from config.py's own comments (a field without one fails here)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('mode = "lora"\n[optim]\nlr = 3e-4\n')
    assert cli.main(["config", "--show", str(cfg), "--json"]) == 0
    table = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert (table["mode"]["value"], table["mode"]["default"]) == ("lora", "full")
    assert (table["optim.lr"]["value"], table["optim.lr"]["default"]) == (3e-4, 1e-4)
    assert [k for k, r in table.items() if not r["meaning"]] == []
    assert "peak learning rate" in table["optim.lr"]["meaning"]
    assert cli.main(["config", "--show", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert "optim.lr = 0.0003  (float, default 0.0001, --lr)" in text
    assert max(len(line) for line in text.splitlines()) <= 100
