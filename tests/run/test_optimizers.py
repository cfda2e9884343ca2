"""Issue 20, the optimizer's rungs: the optimizer step in backward (one optimizer per parameter,
stepped as its gradient is formed, which then frees it) and bitsandbytes' 8-bit AdamW, run by the
engine and planned to the byte."""

import json

import pytest

from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.errors import ConfigError
from trainplan.plan import analytic
from trainplan.plan.tensors import bnb_cpu_temp_bytes, optimizer_state_bytes
from trainplan.resolve import resolve
from trainplan.verify.checks import check_memory

torch = pytest.importorskip("torch")

# what the step in backward requires: no clipping, no guard (it decides before the update), accumulation 1
IN_BACKWARD = ["optim.step_in_backward=true", "train.max_grad_norm=0", "guard.enabled=false"]


def train(settings, out, *extra):
    cfg = C.load(None, [*settings, "train.eval_batches=1", f"train.output_dir={out}", *extra])
    return execute(cfg, quiet=True)[0]


def history(record) -> list[tuple[float, float]]:
    return [(s["loss"], s["grad_norm"]) for s in record.to_json()["steps"]]


@pytest.fixture(scope="module")
def wide_layers(tiny_run, tmp_path_factory):
    """Four layers with a wide MLP, so that the layers' gradients, not the 49k-token embedding's,
    are most of the gradients, and one sequence per step, so that the update, not forward's
    activations, makes the peak: the step in backward's saving shows in it."""
    root, base = tiny_run
    config = json.loads((root / "config.json").read_text())
    d = tmp_path_factory.mktemp("wide")
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4, "intermediate_size": 4096}))
    kept = [s for s in base if not s.startswith(("model.source=", "batch.micro_batch_size="))]
    return [*kept, f"model.source={d / 'config.json'}", "batch.micro_batch_size=1"]


def test_the_step_in_backward_changes_nothing_but_memory_and_resumes_bitwise(tiny_run, tmp_path):
    """fp32, AdamW with weight decay, a warm-up schedule, no clipping: the losses, gradient norms, LRs and
    final weights equal the plain run's bit for bit; a run stopped at step 2 and resumed from its checkpoint
    ends where the uninterrupted one does."""
    root, base = tiny_run
    common = [*base, "train.steps=4", "train.warmup_steps=2", "optim.weight_decay=0.1", "train.measure_memory=false"]
    common += ["train.max_grad_norm=0", "guard.enabled=false"]
    plain = train(common, tmp_path / "plain").to_json()
    stepped = train(common, tmp_path / "in-bwd", "optim.step_in_backward=true").to_json()
    key = [(s["loss"], s["grad_norm"], s["lr"]) for s in plain["steps"]]
    assert [(s["loss"], s["grad_norm"], s["lr"]) for s in stepped["steps"]] == key
    assert len({s["lr"] for s in plain["steps"]}) == 3  # the schedule moves: every per-parameter LR followed it
    assert stepped["final"]["weights_hash"] == plain["final"]["weights_hash"]
    assert stepped["final"]["optimizer_hash"] == plain["final"]["optimizer_hash"]

    ck = ["optim.step_in_backward=true", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=2"]
    train(common, tmp_path / "a", *ck, "train.stop_after=2")
    resumed = train(common, tmp_path / "b", *ck, "checkpoint.resume=auto").to_json()
    assert resumed["resume"]["step"] == 2
    assert [(s["loss"], s["grad_norm"]) for s in resumed["steps"]] == [(s[0], s[1]) for s in key[2:]]
    assert resumed["final"]["weights_hash"] == plain["final"]["weights_hash"]


def test_the_step_in_backward_plan_matches_the_measured_step_and_is_below_the_plain_peak(wide_layers, tmp_path):
    record = train(wide_layers, tmp_path, *IN_BACKWARD)
    ledger = analytic.plan(C.from_dict(record.config))
    check = check_memory(record, ledger, 0.05)
    print(check.summary)
    assert check.passed, check.summary
    (rank,) = record.memory["per_rank"]
    assert set(rank["phases"]) == {"forward", "backward"}  # no optimizer phase: the updates ran in backward
    dev = ledger.devices[0]
    assert "optimizer" not in dev.phases and dev.phases["backward"].get("optimizer_temp", 0) > 0
    plain = analytic.plan(C.load(None, [*wide_layers, "train.max_grad_norm=0", "guard.enabled=false"])).devices[0]
    print(f"planned peak: plain {plain.peak_allocated:,} B, in backward {dev.peak_allocated:,} B")
    assert dev.peak_allocated < plain.peak_allocated
    # the gradients never exist at once: at most the largest tensor's (the 49k x 64 tied embedding)
    assert max(ph.get("gradients", 0) for ph in rank["phases"].values()) <= 49152 * 64 * 4


def _unique_state_bytes(optimizer) -> int:
    """What the optimizer's state holds, each storage once (bitsandbytes shares its quantization maps)."""
    storages = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("in_backward", [False, True])
def test_8bit_adamw_states_are_planned_to_the_byte(tiny_llama, in_backward):
    """bitsandbytes' AdamW8bit on its CPU backend, one step of a tiny model: uint8 states with fp32 absmax
    per 256 elements, 32-bit states under 4096 elements, the shared quantization maps (one pair per
    optimizer), a Python-int step: the planner's bytes equal the state's storages."""
    pytest.importorskip("bitsandbytes")
    import transformers

    from trainplan.run import step
    from trainplan.spec.precision import PRECISIONS

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**tiny_llama))
    opt = step.build_optimizer(model, "adamw-8bit", "auto", 1e-3, 0.0, "cpu", in_backward=in_backward)
    ids = torch.randint(0, tiny_llama["vocab_size"], (2, 16))
    settings = step.StepSettings(prec=PRECISIONS["fp32"], device_type="cpu", max_grad_norm=None)
    step.train_step(model, step.Update(opt), [{"input_ids": ids, "labels": ids}], settings)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert any(p.numel() < 4096 for p in model.parameters()) and any(p.numel() >= 4096 for p in model.parameters())
    planned = optimizer_state_bytes("adamw-8bit", shapes, 4, True, in_backward=in_backward)
    assert _unique_state_bytes(opt) == planned


def test_8bit_adamw_cpu_step_temporaries_are_planned(tiny_llama):
    """The CPU backend's update of one 8-bit tensor, its Python body run under the storage tracker
    (the custom op hides it from a run's tracker): the planner's temporaries, to the byte."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.backends.cpu import ops as cpu_ops

    from trainplan import _torch_private as P

    p = torch.nn.Parameter(torch.randn(128, 64))
    opt = __import__("bitsandbytes").optim.AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    s = opt.state[p]
    tracker = P.StorageTracker()
    tracker.track(torch.nn.Module(), None, [p, p.grad, *(v for v in s.values() if isinstance(v, torch.Tensor))])
    with tracker, torch.no_grad():
        tracker.reset_peak()
        before = tracker.total
        cpu_ops._optimizer_update_8bit_blockwise_cpu(
            "adam", p.grad, p, s["state1"], s["state2"], 0.9, 0.999, 0.0, 0.0, 1e-8, 2, 1e-3,
            s["qmap1"], s["qmap2"], s["absmax1"], s["absmax2"], 0.0, 1.0,
        )  # fmt: skip
        measured = tracker.peak_total - before
    assert measured == bnb_cpu_temp_bytes(p.numel(), 4)


def test_8bit_adamw_trains_close_to_adamw(tiny_run, tmp_path):
    """A different optimizer, so not bitwise: the loss difference to AdamW after a few steps, reported."""
    pytest.importorskip("bitsandbytes")
    root, base = tiny_run
    common = [*base, "train.steps=4"]
    plain = [s for s, _ in history(train([*common, "train.measure_memory=false"], tmp_path / "adamw"))]
    record = train(common, tmp_path / "8bit", "optim.name=adamw-8bit")
    eight = [s for s, _ in history(record)]
    diffs = [b - a for a, b in zip(plain, eight, strict=True)]
    print("adamw", plain, "adamw-8bit", eight, "difference", diffs)
    assert all(map(lambda x: x == x and abs(x) != float("inf"), eight))
    assert diffs[0] == 0.0  # the same weights before the first update
    assert max(abs(d) for d in diffs) < 0.02 * plain[0]
    assert eight[-1] < eight[0]  # and it learns
    # accept's memory check on the CPU: the 8-bit update's fp32 temporaries (inside bitsandbytes' custom
    # op) are measured, and every phase is the plan's within 5 %
    from trainplan.plan import analytic
    from trainplan.verify import checks

    check = checks.check_memory(record, analytic.plan(C.from_dict(record.config)), 0.05)
    rows = {r["phase"]: r for r in check.evidence["rows"] if r["component"] == "optimizer"}
    assert check.passed, check.summary
    assert rows["optimizer"]["measured"] > 4 * rows["forward"]["measured"]  # states + the update's temporaries


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["batch.grad_accum_steps=2"], "batch.grad_accum_steps: is 2, but optim.step_in_backward"),
        (["train.max_grad_norm=1"], "train.max_grad_norm: is 1: clipping by the global norm needs every gradient"),
        (["guard.enabled=true"], "guard.enabled: the stability guard decides"),
        (["precision=amp-fp16"], "run.precision: amp-fp16 scales the loss"),
        (["hardware.gpus=2xH100-80GB"], "optim.step_in_backward: runs in one process only, not on 2 devices"),
    ],
)
def test_what_the_step_in_backward_cannot_do_is_refused_in_one_line(tiny_run, extra, message):
    root, base = tiny_run
    with pytest.raises(ConfigError) as e:
        resolve(C.load(None, [*base, *IN_BACKWARD, *extra]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert "optim.step_in_backward = false" in str(e.value)  # names the way out


def test_the_trace_refuses_the_step_in_backward_rather_than_trace_another_step(tiny_run):
    from trainplan.errors import TrainplanError
    from trainplan.plan import traced

    root, base = tiny_run
    cfg = C.load(None, [*base, "optim.step_in_backward=true", "train.max_grad_norm=0", "guard.enabled=false"])
    with pytest.raises(TrainplanError, match="optim.step_in_backward: the trace runs the plain optimizer step"):
        traced.trace(cfg)
