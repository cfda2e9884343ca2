"""The result of every run, saved at its end in the ecosystem's format, whatever checkpoint.every is."""

import json

import pytest

from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.errors import EXIT_STOPPED
from trainplan.run import checkpoint, dist, evaluate, setup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def cfg_for(tiny_run, out, *extra):
    root, base = tiny_run  # root / "weights": the tiny Llama saved with its tokenizer
    settings = [*base, f"model.source={root / 'weights'}", "model.init=auto", f"train.output_dir={out}"]
    return C.load(None, [*settings, "train.measure_memory=false", *extra])


def _held_out(model, cfg) -> dict:
    """The held-out metric of `model` on the run's own held-out split and packing, as trainplan evaluates."""
    job = setup.prepare(cfg, dist.init())
    return evaluate.evaluate(
        model,
        job.eval.ids,
        job.eval.labels,
        micro_batch=cfg.batch.micro_batch_size,
        max_batches=cfg.train.eval_batches,
        prec=job.resolved.precision,
        device=torch.device("cpu"),
    )


def test_a_lora_run_leaves_a_peft_adapter_with_the_runs_weights(tiny_run, tmp_path):
    from peft import PeftModel

    cfg = cfg_for(tiny_run, tmp_path, "mode=lora", "train.steps=3", "checkpoint.every=50")
    record = execute(cfg, quiet=True)[0].to_json()
    result = record["result"]
    assert result["format"] == "peft-adapter" and not (tmp_path / "checkpoints").exists()  # 3 steps, every 50
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(result["files"])
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_run[0] / "weights"), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, result["path"], is_trainable=True)
    weights = sorted(checkpoint.trainable_state(loaded).items())
    assert len(weights) == 2 * 2 * 2  # lora_A and lora_B on q_proj and v_proj of 2 layers
    assert checkpoint.tensor_hash(weights) == record["final"]["weights_hash"]  # bitwise the run's
    transformers.AutoTokenizer.from_pretrained(result["path"])


def test_a_lora_result_loads_with_plain_peft_alone_and_gives_the_runs_held_out_loss(tiny_run, tmp_path, monkeypatch):
    """No trainplan on the loading side: adapter_config.json names the exact base the run loaded, PEFT
    finds it offline by itself, and the loaded model's held-out loss is the run's; the model card says
    what was trained, on what, how, and how well."""
    from pathlib import Path

    from peft import AutoPeftModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = cfg_for(tiny_run, tmp_path, "mode=lora", "train.steps=3")
    record = execute(cfg, quiet=True)[0].to_json()
    path = Path(record["result"]["path"])
    base = str((tiny_run[0] / "weights").resolve())
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert record["result"]["base_model"] == base
    model = AutoPeftModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    again = _held_out(model, cfg)
    assert again["loss"] == pytest.approx(record["eval_after"]["loss"], rel=1e-5)
    card = (path / "README.md").read_text()
    assert card.startswith(f'---\nbase_model: "{base}"\nlibrary_name: peft\n')
    for fact in (
        f"{record['eval_before']['loss']:.4f} before, {record['eval_after']['loss']:.4f} after",
        f"`{record['data']['source']}` (fingerprint {record['data']['fingerprint']})",
        "3 steps, micro-batch 4 x accumulation 1 = global batch 4 of 32 tokens",
        "LoRA r 8, alpha 16",
        f"{record['train_seconds']:.1f} s of training steps",
    ):
        assert fact in card, (fact, card)
    assert "More Information Needed" not in card  # PEFT's empty template is gone


def test_an_adapter_on_random_weights_names_no_base_and_says_why(tiny_run, tmp_path):
    root, base = tiny_run  # config.json, model.init = random: the base weights exist nowhere
    cfg = C.load(
        None, [*base, "mode=lora", "train.steps=2", f"train.output_dir={tmp_path}", "train.measure_memory=false"]
    )
    record = execute(cfg, quiet=True)[0].to_json()
    path = tmp_path / "result"
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert "never saved, so there is no base to load this result onto" in (path / "README.md").read_text()
    assert record["result"]["loads_with"].startswith("nothing: its base had random weights")


def test_the_embedded_defaults_base_is_its_dequantized_directory_which_loads_alone():
    from trainplan.run import weights
    from trainplan.spec.model import default_gguf_path

    cfg = C.load(None, [])
    ref = weights.base_reference(cfg)
    assert ref == str(weights.gguf_cache(default_gguf_path(), cfg.model.cache_dir).resolve())
    config = transformers.AutoConfig.from_pretrained(ref)  # a transformers directory, tokenizer beside it
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert len(transformers.AutoTokenizer.from_pretrained(ref)) == 49152


def test_a_full_run_leaves_a_model_that_reproduces_its_held_out_loss(tiny_run, tmp_path):
    cfg = cfg_for(tiny_run, tmp_path, "mode=full", "train.steps=2")
    record = execute(cfg, quiet=True)[0].to_json()
    assert record["result"]["format"] == "transformers"
    model = transformers.AutoModelForCausalLM.from_pretrained(record["result"]["path"], dtype=torch.float32)
    again = _held_out(model, cfg)
    assert again["loss"] == pytest.approx(record["eval_after"]["loss"], rel=1e-6)
    assert again["loss"] < record["eval_before"]["loss"]


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint_and_the_result(tiny_run, tmp_path, capsys):
    """SIGINT at step 2 (a real signal to this process): the step finishes, a checkpoint and the
    result are written, the exit code is 3 (stopped, resumable) and no traceback; resume=auto then finishes the run."""
    from trainplan import cli

    root, base = tiny_run
    out, ck = tmp_path / "run", tmp_path / "ck"
    sets = [*base, "mode=lora", "train.steps=4", "checkpoint.every=0", f"checkpoint.dir={ck}", "train.eval_batches=1"]
    args = ["train", *(x for s in sets for x in ("--set", s)), "--output-dir", str(out), "--registry", "off"]
    assert cli.main([*args, "--set", "guard.inject=['sigint@2']"]) == EXIT_STOPPED
    printed = capsys.readouterr()
    assert "interrupted by SIGINT after step 2: checkpoint and result saved" in printed.out
    assert "Traceback" not in printed.err
    assert checkpoint.validate(ck / "step-00000002") is None and not (ck / "step-00000003").exists()
    assert (out / "result" / "adapter_model.safetensors").is_file()
    assert cli.main([*args, "--set", "checkpoint.resume='auto'"]) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["resume"]["step"] == 2 and [s["step"] for s in record["steps"]] == [3, 4]


@pytest.mark.slow
def test_the_gguf_conversion_is_a_stage_of_its_own_without_a_redrawn_bar(tmp_path, caplog, capfd):
    """The one-time conversion of the embedded default (24 s on a 2-core CPU) says what it does and how
    long it took, and, piped, draws no tqdm bar (no carriage returns)."""
    import logging

    from trainplan.run import weights
    from trainplan.spec.model import default_gguf_path

    with caplog.at_level(logging.INFO, logger="trainplan"):
        target = weights.gguf_cache(default_gguf_path(), str(tmp_path / "cache"))
    lines = [r.getMessage() for r in caplog.records if r.name == "trainplan"]
    assert lines[0].startswith(f"convert GGUF {default_gguf_path().name} to safetensors in {target}")
    assert lines[-1].startswith("convert GGUF done in ") and lines[-1].endswith("s")
    assert "\r" not in capfd.readouterr().err  # pytest's stderr is no terminal
    assert (target / "model.safetensors").is_file()
    # a random-init run's tokenizer: the whole conversion serves, where it is cached already
    assert weights.gguf_tokenizer(default_gguf_path(), str(tmp_path / "cache")) == target
