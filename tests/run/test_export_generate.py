"""Using a run's result: `trainplan export` (merged, adapter, from a checkpoint), `trainplan
generate` (streamed or JSON, --compare), and accept's before/after samples, on one tiny LoRA run."""

import dataclasses
import json
import shutil

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.run import checkpoint, dist, evaluate, setup
from trainplan.run import generate as G
from trainplan.run.record import RunRecord

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "The for statement"
# PEFT's loader reads transformers' deprecated is_gradient_checkpointing
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def lora_cfg(tiny_run, out, *extra):
    root, base = tiny_run  # root / "weights": the tiny Llama saved with its tokenizer
    settings = [*base, f"model.source={root / 'weights'}", "model.init=auto", f"train.output_dir={out}"]
    # lr 1e-2 for 8 steps: enough to change the tiny model's greedy tokens
    return C.load(
        None, [*settings, "mode=lora", "train.steps=8", "optim.lr=1e-2", "train.measure_memory=false", *extra]
    )


@pytest.fixture(scope="module")
def lora_run(tiny_run, tmp_path_factory):
    """A LoRA run with a checkpoint at its last step (the same weights as its result)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = lora_cfg(tiny_run, out, "checkpoint.every=8")
    record = execute(cfg, quiet=True)[0]
    return cfg, out, record


def weights_of(tiny_run):
    return str(tiny_run[0] / "weights")


def base_model(tiny_run):
    return transformers.AutoModelForCausalLM.from_pretrained(weights_of(tiny_run), dtype=torch.float32).eval()


def direct_greedy(model, tokenizer, ids, n):
    """transformers' own greedy decoding, as a user would call it."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def held_out_loss(model, cfg, tmp_path) -> float:
    """The held-out metric of `model` on the run's own held-out split and packing."""
    job = setup.prepare(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(tmp_path))), dist.init()
    )
    for lock in job.locks:
        lock.release()
    return evaluate.evaluate(
        model,
        job.eval.ids,
        job.eval.labels,
        micro_batch=cfg.batch.micro_batch_size,
        max_batches=cfg.train.eval_batches,
        prec=job.resolved.precision,
        device=torch.device("cpu"),
    )["loss"]


def test_merge_writes_a_transformers_model_with_the_runs_held_out_loss(lora_run, tmp_path, capsys):
    cfg, out, record = lora_run
    merged = tmp_path / "merged"
    assert cli.main(["export", str(out), "--merge", "-o", str(merged)]) == 0
    assert "transformers model" in capsys.readouterr().out
    files = {p.name for p in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not any(f.endswith((".bin", ".pt")) or f.startswith(".") for f in files)
    assert not list(tmp_path.glob(".merged*"))  # no temporary directory left beside it
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert held_out_loss(model, cfg, tmp_path / "eval") == pytest.approx(record.eval_after["loss"], rel=1e-5)
    assert record.eval_after["loss"] < record.eval_before["loss"]


def test_without_merge_a_run_id_gives_the_adapter_peft_loads(lora_run, tmp_path):
    cfg, out, record = lora_run
    assert record.registry_id is not None
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "old").write_text("x")
    assert cli.main(["export", str(record.registry_id), "-o", str(adapter)]) == 2  # not empty
    assert cli.main(["export", str(record.registry_id), "-o", str(adapter), "--force"]) == 0
    assert not (adapter / "old").exists() and not list(tmp_path.glob(".adapter*"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}
    base = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.source, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
    weights = sorted(checkpoint.trainable_state(loaded).items())
    assert checkpoint.tensor_hash(weights) == record.final["weights_hash"]  # bitwise the run's


def test_a_checkpoint_exports_as_its_result_does(lora_run, tmp_path):
    """Rebuilt from the checkpoint's own config: merged bitwise equal to the result merged, and
    its adapter bitwise the run's."""
    cfg, out, record = lora_run
    step = out / "checkpoints" / "step-00000008"
    assert cli.main(["export", str(step), "--merge", "-o", str(tmp_path / "a")]) == 0
    assert cli.main(["export", str(out / "result"), "--merge", "-o", str(tmp_path / "b")]) == 0
    assert same_tensors(tmp_path / "a", tmp_path / "b", "model.safetensors")
    assert cli.main(["export", str(step), "-o", str(tmp_path / "adapter")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.source, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"), is_trainable=True)
    assert checkpoint.tensor_hash(sorted(checkpoint.trainable_state(loaded).items())) == record.final["weights_hash"]


def test_generate_with_the_adapter_gives_the_fine_tuned_models_greedy_tokens(lora_run, tiny_run, capsys):
    cfg, out, record = lora_run
    args = ["generate", weights_of(tiny_run), "--adapter", str(out / "result"), "--prompt", PROMPT]
    assert cli.main([*args, "--max-new-tokens", "12", "--compare", "--no-chat-template", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["results"][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "result"))
    ids = tokenizer(PROMPT)["input_ids"]
    base = base_model(tiny_run)
    expected_base = direct_greedy(base, tokenizer, ids, 12)
    tuned = peft.PeftModel.from_pretrained(base, str(out / "result")).eval()
    expected_tuned = direct_greedy(tuned, tokenizer, ids, 12)
    assert got["fine_tuned"]["tokens"] == expected_tuned and got["base"]["tokens"] == expected_base
    assert expected_tuned != expected_base  # the training changed what the model says
    assert got["fine_tuned"]["text"] == tokenizer.decode(expected_tuned, skip_special_tokens=True)


def test_generate_streams_labelled_text_and_reads_a_run_as_model(lora_run, tmp_path, capsys):
    cfg, out, record = lora_run
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\nclass\n")
    common = ["--no-chat-template", "--max-new-tokens", "6"]
    assert cli.main(["generate", str(out), "--prompts", str(prompts), "--compare", *common]) == 0
    text = capsys.readouterr().out
    assert text.count("--- base:") == 2 and text.count("--- fine-tuned (result") == 2
    assert f"### prompt 1: {PROMPT}" in text and "### prompt 2: class" in text
    assert cli.main(["generate", str(out), "--prompt", PROMPT, *common, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["completion"]["text"] in text  # streamed the same greedy text
    assert not doc["chat_template"]
    # by default the prompt goes through the tokenizer's chat template, as one user turn
    assert cli.main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "result"))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert doc["chat_template"] and doc["results"][0]["prompt_tokens"] == len(chat["input_ids"])


def test_samples_before_and_after_round_trip_through_the_record(lora_run, tiny_run):
    cfg, out, record = lora_run
    samples = G.run_samples(record.config, record.result, new_tokens=8)
    assert len(samples) == min(G.SAMPLE_PROMPTS, record.data["eval_documents"]) >= 2
    assert all(set(s) == {"prompt", "before", "after"} for s in samples)
    assert any(s["before"] != s["after"] for s in samples)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "result"))
    first = G.held_out_prompts(cfg, tokenizer)[0]
    assert samples[0]["prompt"] == tokenizer.decode(first, skip_special_tokens=True)
    expected = direct_greedy(base_model(tiny_run), tokenizer, first, 8)
    assert samples[0]["before"] == tokenizer.decode(expected, skip_special_tokens=True)
    rec = dataclasses.replace(record, samples=samples)
    again = RunRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert again.samples == samples
    old = {k: v for k, v in rec.to_json().items() if k != "samples"}  # a record from before the field
    assert RunRecord.from_json(old).samples is None and "samples" not in record.to_json()


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """An adapter for a narrower model (hidden 32): it fits nowhere in the tiny one (hidden 64)."""
    path = tmp_path_factory.mktemp("other") / "adapter"
    narrow = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    lora = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4)
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(narrow), lora).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "args, field",
    [
        (["generate", "{weights}"], "--prompt"),  # no prompt: argparse names the two flags
        (["generate", "{weights}", "--prompts", "{tmp}/missing.txt"], "--prompts"),
        (["generate", "{weights}", "--prompt", ""], "--prompt"),
        (["generate", "{weights}", "--prompt", "x", "--adapter", "{tmp}"], "--adapter"),  # no adapter there
        (["generate", "{weights}", "--prompt", "x", "--adapter", "{other}"], "--adapter"),  # another model's
        (["generate", "{weights}", "--prompt", "x", "--compare"], "--compare"),  # nothing to compare with
        (["generate", "{weights}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "{tmp}/nope", "--prompt", "x"], "MODEL"),
        (["export", "{tmp}/nope", "-o", "{tmp}/out"], "RUN_OR_CHECKPOINT"),
        (["export", "{run}", "--merge", "-o", "{tmp}"], "-o"),  # not empty, no --force
    ],
)
def test_bad_input_is_one_line_naming_the_flag_exit_2(lora_run, tiny_run, other, tmp_path, capsys, args, field):
    cfg, out, record = lora_run
    (tmp_path / "stuff").write_text("x")
    values = {"weights": weights_of(tiny_run), "tmp": str(tmp_path), "other": str(other), "run": str(out)}
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main([a.format(**values) for a in args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def one_step_run(tiny_run, source, out, *extra):
    """One step with a checkpoint after it: the checkpoint holds the result's weights."""
    sets = [*tiny_run[1], f"model.source={source}", "model.init=auto", f"train.output_dir={out}", "train.steps=1"]
    sets += ["checkpoint.every=1", "train.eval_batches=1", "train.measure_memory=false", *extra]
    execute(C.load(None, sets), quiet=True)
    return out / "checkpoints" / "step-00000001"


def same_tensors(a, b, name) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a / name)), load_file(str(b / name))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_sharded_checkpoint_exports_its_adapter_and_one_of_another_model_is_refused(tiny_run, tmp_path, capsys):
    """zero3 writes DCP shards: read back in one process, the adapter is bitwise the result's.
    Then the base model changes after the run: its fingerprint no longer matches, refused."""
    source = tmp_path / "model"
    shutil.copytree(tiny_run[0] / "weights", source)
    step = one_step_run(tiny_run, source, tmp_path / "run", "mode=lora", "parallel.strategy=zero3")
    assert (step / "dcp").is_dir()
    assert cli.main(["export", str(tmp_path / "run" / "checkpoints"), "-o", str(tmp_path / "adapter")]) == 0
    assert same_tensors(tmp_path / "adapter", tmp_path / "run" / "result", "adapter_model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert cli.main(["export", str(step), "--merge", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "belongs to another model" in err and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))  # the refusal came mid-export: its temporary directory is gone


def test_a_full_runs_checkpoint_exports_as_its_result(tiny_run, tmp_path):
    step = one_step_run(tiny_run, tiny_run[0] / "weights", tmp_path / "run", "mode=full")
    assert cli.main(["export", str(step), "-o", str(tmp_path / "model")]) == 0
    assert same_tensors(tmp_path / "model", tmp_path / "run" / "result", "model.safetensors")


def test_sampling_is_seeded_and_greedy_is_the_default(tiny_run):
    model = base_model(tiny_run)
    tokenizer = transformers.AutoTokenizer.from_pretrained(weights_of(tiny_run))
    ids = tokenizer(PROMPT)["input_ids"]

    def sample(**kw):
        return G.complete(model, tokenizer, ids, max_new_tokens=8, **kw)

    assert sample(temperature=1.0, seed=3) == sample(temperature=1.0, seed=3) != sample(temperature=1.0, seed=4)
    assert sample() == direct_greedy(model, tokenizer, ids, 8) != sample(temperature=1.0, seed=3)


def test_a_16bit_precision_on_a_cpu_without_its_instructions_warns_and_auto_does_not(tiny_run, tmp_path, monkeypatch):
    import logging

    from trainplan.run.progress import Progress

    monkeypatch.setattr(setup, "cpu_native_16bit", lambda dtype: False)  # an AVX2-only core
    for precision, runs_as in (("amp-bf16", "amp-bf16"), ("auto", "fp32")):
        progress, lines = Progress.off(), []
        progress.line = lambda text, level=logging.INFO, lines=lines: lines.append((level, text))
        job = setup.prepare(lora_cfg(tiny_run, tmp_path / precision, f"precision={precision}"), dist.init(), progress)
        for lock in job.locks:
            lock.release()
        assert job.resolved.precision.name == runs_as
        warned = [text for level, text in lines if level == logging.WARNING]
        if precision == "auto":
            assert not warned
        else:
            assert warned == [
                "warning: precision amp-bf16: this CPU has no bf16 instructions, so torch emulates its bf16 "
                'matmuls (tens of times slower than fp32); precision = "fp32" (or "auto") is faster here'
            ]
