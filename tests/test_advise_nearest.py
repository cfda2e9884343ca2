"""A next step on every TIGHT and DOES NOT FIT (advise/nearest.py): the fewest rungs of the memory ladder
on top of the user's config, re-planned with the same planner and verdict, runnable by `train`."""

from __future__ import annotations

import json
import shlex

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.advise import nearest
from trainplan.plan.analytic import plan
from trainplan.plan.verdict import FITS

# (model, mode, devices, micro-batch, seq, strategy): each over on its own devices as given
OVER = [
    ("Llama-3.1-8B", "lora", "RTX4090", 1, 2048, "ddp"),  # the issue's case: checkpointing fits
    ("Llama-3.1-8B", "full", "2xH100-80GB", 1, 2048, "ddp"),
    ("Llama-3.1-8B", "full", "H100-80GB", 1, 2048, "ddp"),
    ("Llama-3.2-3B", "full", "RTX4090", 1, 1024, "ddp"),
    ("Llama-3.2-1B", "full", "1x12GiB", 8, 2048, "ddp"),
    ("Qwen2.5-7B", "lora", "L4", 4, 4096, "ddp"),
    ("Qwen2.5-7B", "full", "8xA100-80GB", 2, 4096, "ddp"),
    ("Llama-3.1-8B", "inference", "1x12GiB", 1, 2048, "ddp"),  # inference: QLoRA is no answer; none may fit
    ("Mistral-7B-v0.3", "lora", "A10G", 2, 4096, "ddp"),
    ("Llama-3.2-3B", "lora", "1x8GiB", 8, 4096, "ddp"),  # three rungs: checkpointing, micro-batch 1, QLoRA
    ("Qwen2.5-0.5B", "full", "1x6GiB", 16, 2048, "ddp"),
]


def cfg_of(model, mode, gpus, micro, seq, strategy):
    return C.load(
        None,
        [],
        {
            "model.source": model,
            "mode": mode,
            "hardware.gpus": gpus,
            "batch.micro_batch_size": micro,
            "batch.seq_len": seq,
            "parallel.strategy": strategy,
            "memory.activation_checkpointing": False,
        },
    )


@pytest.mark.parametrize("case", OVER, ids=lambda c: "-".join(map(str, c)))
def test_the_next_step_re_planned_from_its_own_settings_fits(case):
    cfg = cfg_of(*case)
    assert plan(cfg).state != FITS, "the case must start over"
    step = nearest.nearest(cfg, budget_s=5)
    if step is None:
        assert case[1] == "inference", "every training case here has a rung that fits"
        return
    again = plan(nearest.with_settings(cfg, step.settings))  # afresh: no state shared with the search
    assert again.state == FITS and again.runnable["ok"]
    assert 1 <= len(step.labels) <= 3  # rungs (one can take two settings: micro-batch and its accumulation)


def test_the_issues_case_prints_checkpointing_and_the_advise_command(capsys):
    argv = ["plan", "--model", "Llama-3.1-8B", "--gpus", "RTX4090", "--mode", "lora", "--seq", "2048"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.split("\n\n") if x.startswith("Next step"))
    assert "--set memory.activation_checkpointing=true" in " ".join(line.split())
    advise = " ".join(line.split()).split("Explore the whole ladder: ", 1)[1]
    assert shlex.split(advise)[:3] == ["trainplan", "advise", "Llama-3.1-8B"]
    assert cli.main([*argv, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["next_step"]["settings"] == {"memory.activation_checkpointing": True}
    assert doc["next_step"]["state"] == FITS


def test_a_plan_that_fits_names_no_next_step(capsys):
    assert cli.main(["plan", "--model", "Llama-3.2-1B", "--gpus", "H100-80GB", "--mode", "lora", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["state"] == FITS and doc["next_step"] is None
