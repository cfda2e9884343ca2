"""Models by Hugging Face Hub id: from the local HF cache (HF_HOME), never downloaded; presets are
named by the Hub ids they describe, their short names kept as aliases."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from trainplan.errors import ConfigError
from trainplan.spec import model as M

REPO = "tinyorg/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home, weights_dir):
    """A model in huggingface_hub's cache layout under HF_HOME: refs/main names a snapshot."""
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(weights_dir, repo / "snapshots" / REVISION)
    return repo / "snapshots" / REVISION


def test_presets_are_named_by_hub_id_and_keep_their_short_names():
    assert "meta-llama/Llama-3.1-8B" in M.preset_names()
    for alias in ("Llama-3.1-8B", "llama-3.1-8b", "meta-llama/Llama-3.1-8B"):
        spec = M.load_model_spec(alias)
        assert spec.name == "meta-llama/Llama-3.1-8B"
        assert spec.num_params == M.load_model_spec("meta-llama/Llama-3.1-8B").num_params
    assert M.load_model_spec("gpt2").name == "openai-community/gpt2"  # the id's repository part
    assert M.load_model_spec("tiny-llama").name == "tiny-llama"  # no Hub id: its own name


def test_a_hub_id_in_no_cache_and_no_preset_says_how_to_download_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=r"model.source: 'nobody/nothing' is not .* in the local Hugging Face cache"):
        M.load_model_spec("nobody/nothing")
    with pytest.raises(ConfigError, match="hf download nobody/nothing"):
        M.load_model_spec("nobody/nothing")


def test_a_preset_hub_id_without_weights_plans_but_is_refused_training(tmp_path, monkeypatch, make_cfg):
    from huggingface_hub import constants

    from trainplan.run import weights

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert M.load_model_spec("Qwen/Qwen3-8B").name == "Qwen/Qwen3-8B"  # the preset: planning needs no weights
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache.*hf download Qwen/Qwen3-8B"):
        weights.is_pretrained(make_cfg(model__source="Qwen/Qwen3-8B"))


@pytest.mark.multiprocess
def test_a_hub_cache_id_plans_and_trains(tiny_run, tmp_path):
    root, base = tiny_run
    snapshot = hub_cache(tmp_path / "hf", root / "weights")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    cli = [sys.executable, "-m", "trainplan"]
    plan = subprocess.run(
        [*cli, "plan", REPO, "--gpus", "cpu", "--seq", "32", "--json"], env=env, capture_output=True, text=True
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["model"]["name"] == REPO
    settings = [s for s in base if not s.startswith(("model.source", "model.init"))]
    records = {}
    for source in (REPO, str(snapshot)):  # by Hub id, and the same files by their path
        out = tmp_path / f"run{len(records)}"
        args = [*cli, "train", "--model", source, "--output-dir", str(out), "--registry", "off"]
        for s in [*settings, "train.steps=1", "checkpoint.every=0", "train.measure_memory=false"]:
            args += ["--set", s]
        train = subprocess.run(args, env=env, capture_output=True, text=True)
        assert train.returncode == 0, train.stderr[-2000:]
        records[source] = json.loads((out / "record.json").read_text())
    assert records[REPO]["config"]["model"]["source"] == REPO
    # the run by id started from the cached weights: the same held-out loss before training
    assert records[REPO]["eval_before"]["loss"] == records[str(snapshot)]["eval_before"]["loss"]


def test_the_cache_is_read_as_huggingface_hub_reads_it_and_a_fifo_ref_blocks_nothing(tmp_path, monkeypatch, tiny_run):
    """trainplan reads the cache's layout itself (refs/main names the snapshot), as
    `snapshot_download(local_files_only=True)` does; a ref that is not a regular file, or not a commit's
    hash, is no snapshot (the preset of that id is planned instead), and nothing blocks on a FIFO."""
    from huggingface_hub import constants, snapshot_download

    from trainplan.spec import hub

    root, _ = tiny_run
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    snapshot = hub_cache(tmp_path / "hf", root / "weights")
    assert hub.cached_snapshot(REPO) == snapshot == type(snapshot)(snapshot_download(REPO, local_files_only=True))
    ref = snapshot.parents[1] / "refs" / "main"
    ref.write_text("../../elsewhere")
    assert hub.cached_snapshot(REPO) is None
    ref.unlink()
    os.mkfifo(ref)
    assert hub.cached_snapshot(REPO) is None
    preset = "meta-llama/Llama-3.1-8B"
    fifo = tmp_path / "hf" / "hub" / ("models--" + preset.replace("/", "--")) / "refs" / "main"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    assert M.load_model_spec(preset).name == preset
