"""Real multi-process runs: torchrun, 2 ranks, gloo on the CPU. Each launch costs ~10 s."""

import json
import subprocess
import sys

import pytest

from trainplan import config as C
from trainplan.run import loop

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def torchrun(tmp_path, base, *extra) -> dict:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "trainplan",
        "train",
    ]
    for item in [*base, f"train.output_dir={out}", *extra]:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "record.json").read_text())


@pytest.fixture(scope="module")
def single_full(tiny_run, tmp_path_factory):
    root, base = tiny_run
    cfg = C.load(
        None,
        [
            *base,
            f"model.source={root / 'weights'}",
            "batch.micro_batch_size=4",
            f"train.output_dir={tmp_path_factory.mktemp('single')}",
        ],
    )
    record = loop.run(cfg, quiet=True)
    record.pop("_env")
    return record


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_data_parallel_full_finetune_matches_one_process(tiny_run, tmp_path, single_full, strategy):
    """2 ranks x micro-batch 2 see the same 4 sequences per step as 1 process x 4: same losses."""
    root, base = tiny_run
    record = torchrun(
        tmp_path, base, f"model.source={root / 'weights'}", "batch.micro_batch_size=2", f"parallel.strategy={strategy}"
    )
    assert record["hardware"]["world_size"] == 2 and record["batch"]["global"] == 4
    assert record["contract"]["passed"], record["contract"]["detail"]
    ours = [s["loss"] for s in record["steps"]]
    ref = [s["loss"] for s in single_full["steps"]]
    assert ours == pytest.approx(ref, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    ("mode", "strategy"), [("lora", "ddp"), ("lora", "zero3"), ("inference", "ddp"), ("inference", "zero3")]
)
def test_lora_and_inference_on_two_ranks(tiny_run, tmp_path, mode, strategy):
    root, base = tiny_run
    record = torchrun(tmp_path, base, f"mode={mode}", "batch.micro_batch_size=2", f"parallel.strategy={strategy}")
    assert record["contract"]["passed"], record["contract"]["detail"]
    if mode == "lora":
        assert record["eval_after"]["loss"] < record["eval_before"]["loss"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_resume_on_two_ranks_is_bitwise(tiny_run, tmp_path, strategy):
    from trainplan.verify.resume import verify

    root, base = tiny_run
    args = [x for item in [*base, "batch.micro_batch_size=2", f"parallel.strategy={strategy}"] for x in ("--set", item)]
    result = verify(args, steps=5, at=2, workdir=tmp_path, nproc=2)
    assert result["passed"], (result["checks"], result["max_deviation"])
    assert result["max_deviation"] == {"loss": 0.0, "grad_norm": 0.0, "lr": 0.0}
