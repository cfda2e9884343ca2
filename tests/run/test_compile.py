"""train.compile: torch.compile on each decoder layer (regional compilation), measured from outside any
dispatch mode, since under one torch.compile runs its frames eagerly."""

from __future__ import annotations

import pytest
import torch

from trainplan import config as C
from trainplan.commands.train import execute


def _run(tiny_run, out, *extra) -> dict:
    root, base = tiny_run
    sets = [*base, f"model.source={root / 'weights'}", "model.init=auto", f"train.output_dir={out}", *extra]
    if any(s.startswith("model.source=") for s in extra):  # a config of its own: random weights, seeded
        sets.append("model.init=random")
    return execute(C.load(None, sets), quiet=True)[0].to_json()


@pytest.mark.multiprocess  # inductor compiles in worker processes
def test_a_dispatch_mode_makes_compile_run_eagerly_and_the_compiled_meter_sees_the_compiled_program():
    """Inductor fuses the chain into one kernel with one output: the profiler's allocator events see
    that (the compiled step's own memory), while under the storage tracker the same call runs
    eagerly and allocates every intermediate, as the eager function does."""
    from torch.profiler import ProfilerActivity, profile

    from trainplan import _torch_private as P

    def chain(x):
        return (((x * 2).sin() * 3).cos() * 4).tanh()

    compiled = torch.compile(chain)
    x = torch.randn(256, 1024)  # 1 MiB per intermediate
    compiled(x)  # compiled once, outside any mode

    def allocated(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(x)
        events, _ = P.memory_timeline(prof)
        return sum(n for _, n in events if n > 0)

    def tracked(fn) -> int:
        tracker = P.StorageTracker()
        with tracker:
            fn(x)
        return tracker.peak_total

    assert allocated(compiled) == x.nbytes  # one fused kernel, one output
    assert allocated(chain) >= 5 * x.nbytes  # eagerly, every op's output
    assert tracked(compiled) == tracked(chain) >= 2 * x.nbytes  # the tracker's call ran eagerly


@pytest.mark.multiprocess
def test_a_compiled_lora_run_trains_as_the_eager_one_and_its_memory_is_the_plans(tiny_run, tmp_path):
    """The compiled run's losses within float noise of the eager run's, the held-out loss within 1 %, the
    compile time in the record, and the compiled step's measured peak per phase (the profiler's
    allocator events) within 5 % of the plan's, which models what the compiled layers save
    (features/torch_compile/plan.py): the eager step's plan misses the compiled step by more than 5 %."""
    import dataclasses
    import json

    from trainplan.plan import analytic
    from trainplan.run.record import RunRecord
    from trainplan.verify import checks

    # wide and long enough that the layers' activations, not the 49,152-token logits, decide the peak
    tiny = json.loads((tiny_run[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**tiny, "hidden_size": 256, "intermediate_size": 1024}))
    sets = ["mode=lora", "train.steps=4", "batch.seq_len=256", f"model.source={tmp_path / 'config.json'}"]
    eager = _run(tiny_run, tmp_path / "eager", *sets)
    compiled = _run(tiny_run, tmp_path / "compiled", *sets, "train.compile=true")
    assert eager.get("compile") is None and compiled["compile"]["seconds"] > 0
    ours, ref = ([s["loss"] for s in r["steps"]] for r in (compiled, eager))
    assert ours == pytest.approx(ref, rel=1e-4)
    assert compiled["eval_after"]["loss"] == pytest.approx(eager["eval_after"]["loss"], rel=0.01)
    measured = compiled["memory"]["per_rank"][0]
    assert measured["method"].startswith("compiled step") and set(measured["phases"]["backward"]) == {"total"}
    cfg = C.from_dict(compiled["config"])
    check = checks.check_memory(RunRecord(**compiled), analytic.plan(cfg), 0.05)
    assert check.passed, check.summary
    assert {r["phase"] for r in check.evidence["rows"]} >= {"forward", "backward", "optimizer"}
    # the eager step's plan is not the compiled step's: the compiled layers save less
    eager_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    miss = checks.check_memory(RunRecord(**compiled), analytic.plan(eager_cfg), 0.05)
    (forward,) = [row for row in miss.evidence["rows"] if row["phase"] == "forward"]
    assert not miss.passed and forward["error_of_peak"] > 0.05, forward


def test_the_trace_of_a_compiled_job_says_it_ran_eagerly(tiny_run):
    from trainplan.plan import traced

    _, base = tiny_run
    result, _ = traced.trace(C.load(None, [*base, "train.compile=true"]))
    assert any(n.startswith("train.compile: traced eagerly") for n in result.notes), result.notes
