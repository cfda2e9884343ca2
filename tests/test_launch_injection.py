"""`trainplan launch` writes only what trainplan meant to run (issue 49): a path, a name or a --set value
holding a newline or a control character is refused, nothing written; one holding `$(...)`, backticks
or quotes is written, and the file, run by bash with stand-ins for torchrun, srun and scontrol, runs
only the stand-in, which receives the string as it was given."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainplan import cli

EXAMPLE = Path(__file__).resolve().parents[1] / "trainplan" / "examples" / "full-llama8b-zero3.toml"
TARGETS = ("torchrun", "slurm", "skypilot", "trainjob")
# each would create a file named pwned-* if a shell ever ran it as code
HOSTILE = "x $(touch pwned-1) `touch pwned-2` ';touch pwned-3;' \";touch pwned-4;\" $HOME"
NEWLINES = ("\n", "\r", "\x1b[2J", "\x00", "\u2028")


def place(tmp_path: Path, name: str) -> Path:
    """The example config, copied to a file of this name."""
    path = tmp_path / name
    shutil.copy(EXAMPLE, path)
    return path


def launch(tmp_path: Path, target: str, config: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / f"job-{target}"
    argv = ["launch", str(config), "--gpus", "16xH100-80GB", "--nodes", "2", "--target", target, "-o", str(out)]
    return cli.main([*argv, *extra]), out


def stubs(tmp_path: Path) -> dict[str, str]:
    """torchrun records its arguments (one a line, NUL-safe as repr); srun runs what it is given;
    scontrol names two nodes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(
        "#!/usr/bin/env python3\nimport os, sys\nopen(os.environ['FAKE_LOG'], 'a').write(repr(sys.argv[1:]) + '\\n')\n"
    )
    (bin_dir / "srun").write_text('#!/bin/bash\nexec "${@:2}"\n')  # drops --kill-on-bad-exit=1
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "node-a\\nnode-b\\n"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "torchrun.args"),
        "MASTER_ADDR": "node-a",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "42",
        "SKYPILOT_NODE_IPS": "10.0.0.1",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": "0",
    }


def run_script(tmp_path: Path, script: str) -> list[list[str]]:
    """bash -n, then bash, in an empty directory: the torchrun stand-in's argument lists."""
    path = tmp_path / "script.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, **stubs(tmp_path)}
    done = subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in work.iterdir()) == [], "the script created files: it ran what nobody wrote"
    assert not list(tmp_path.rglob("pwned-*"))
    import ast

    return [ast.literal_eval(line) for line in Path(env["FAKE_LOG"]).read_text().splitlines()]


def shell_of(target: str, text: str) -> str:
    if target == "skypilot":
        return yaml.safe_load(text)["run"]
    return text


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", TARGETS)
def test_quotes_and_substitutions_reach_torchrun_as_written(tmp_path, target):
    config = place(tmp_path, f"cfg {HOSTILE}.toml".replace("/", "_"))
    escaped = f"/shared/{HOSTILE}".replace('"', '\\"')  # a TOML string: its quotes escaped
    set_arg = f'train.output_dir="{escaped}"'
    code, out = launch(tmp_path, target, config, "--set", set_arg)
    assert code == 0
    text = out.read_text()
    if target == "trainjob":  # exec form: no shell between the pod and torchrun
        job = yaml.safe_load(text)
        command = job["spec"]["trainer"]["command"]
        assert command[0] == "torchrun" and str(config) in command
        assert set_arg in command
        return
    calls = run_script(tmp_path, shell_of(target, text))
    assert len(calls) == 1
    argv = calls[0]
    assert str(config) in argv, argv  # the path, byte for byte
    assert set_arg in argv, argv


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", NEWLINES, ids=ascii)
@pytest.mark.parametrize("where", ["config path", "--set value", "--name", "--image"])
def test_a_control_character_is_refused_and_nothing_is_written(tmp_path, capsys, target, bad, where):
    if where == "--image" and target != "trainjob":
        pytest.skip("only TrainJob names an image")
    if where == "config path" and bad == "\x00":
        pytest.skip("no file name holds a NUL")
    config = place(tmp_path, f"cfg{bad}x.toml" if where == "config path" else "cfg.toml")
    shared = ["--set", 'train.output_dir="/shared/runs/x"']
    extra = {
        "config path": shared,
        "--set value": ["--set", f'train.output_dir="/shared/a{bad}touch pwned"'],
        "--name": [*shared, "--name", f"job{bad}touch pwned"],
        "--image": [*shared, "--image", f"img{bad}touch pwned"],
    }[where]
    code, out = launch(tmp_path, target, config, *extra)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    named = {"config path": "config", "--set value": "train.output_dir", "--name": "--name", "--image": "--image"}
    assert named[where] in err and "control character" in err, err
    assert not out.exists()
