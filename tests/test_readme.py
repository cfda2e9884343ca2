"""The README's "from your data to a model you can use" section, run exactly as written."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def section_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## From your data to a model you can use", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_from_your_data_to_a_model_you_can_use(tmp_path):
    commands = section_commands()
    assert 1 <= len(commands) <= 6 and all(c.startswith("trainplan ") for c in commands)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the paths the README names, relative
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for command in commands:
        r = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0, (command, r.stderr[-2000:])
        outputs.append(r.stdout)
    assert "FITS on every device" in outputs[0]
    assert "From the data: 32 training documents" in outputs[0] and "widest micro-batch: step" in outputs[0]
    assert (tmp_path / "runs/mine/record.json").is_file() and any((tmp_path / "runs/mine/tensorboard").iterdir())
    base, tuned = outputs[2].split("--- fine-tuned", 1)
    assert base.startswith("--- base:") and base.split(":", 1)[1].strip() != tuned.split(":", 1)[1].strip()
    assert (tmp_path / "runs/mine-merged/config.json").is_file()
    assert (tmp_path / "runs/mine-merged/model.safetensors").is_file()
    # the merged model answers as the adapter did: the same greedy text
    assert outputs[4].strip() == tuned.split(":", 1)[1].strip()


def test_the_demo_figures_are_the_scripts_block(bench_script):
    """The README's demo figures sit between bench/docs_figures.py's markers, once, in the shape it
    writes (accept's verdict, then one row per run), and rewriting the block leaves the rest alone."""
    figures = bench_script("docs_figures")
    text = (ROOT / "README.md").read_text()
    block = text.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0]
    assert "trainplan accept: PASS" in block and block.count("\n| ") >= 3  # header, rule, two runs
    redone = figures.write_block(text, "NEW")
    assert redone.replace(f"{figures.BEGIN}\nNEW\n{figures.END}", "<>") == text.replace(
        f"{figures.BEGIN}{block}{figures.END}", "<>"
    )
    with pytest.raises(SystemExit, match="must hold"):
        figures.write_block(text + figures.BEGIN, "NEW")
