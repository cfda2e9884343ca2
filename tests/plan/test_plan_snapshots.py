"""`plan --json` pinned byte for byte over the shipped examples, every configuration of
bench/trace_accuracy.py, and the strategies, precisions and optimizers that branch the ledger.

A refactor of the planner must leave every figure unchanged; a deliberate change to a formula
regenerates the file and shows its diff in review:

    TRAINPLAN_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/plan/test_plan_snapshots.py
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import pytest

from trainplan import config as C
from trainplan.errors import TrainplanError
from trainplan.plan.analytic import plan
from trainplan.spec.model import default_gguf_path

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).with_name("plan_snapshots.json")
FIXED_HOST = "1x24GiB"  # the examples that say "auto" or "cpu" would otherwise plan this machine


def _bench_matrix() -> list[tuple]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import trace_accuracy
    finally:
        sys.path.pop(0)
    return trace_accuracy.MATRIX, trace_accuracy.lora_targets


def cases() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted((ROOT / "examples").glob("*.toml")):
        gpus = tomllib.loads(path.read_text()).get("hardware", {}).get("gpus", "auto")
        settings = {"hardware.gpus": FIXED_HOST} if gpus in ("auto", "cpu") else {}
        if gpus in ("auto", "cpu") and "qlora" not in path.name:
            settings["precision"] = "fp32"
        out[f"example:{path.stem}"] = {"config": str(path), "settings": settings}
    matrix, targets = _bench_matrix()
    for _family, preset, mode, micro, seq, ac, gpus, strategy, *extra_settings in matrix:
        attention, precision = (*extra_settings, None, None)[:2]
        settings = {
            "model.source": preset,
            "mode": mode,
            "batch.micro_batch_size": micro,
            "batch.seq_len": seq,
            "memory.activation_checkpointing": ac,
            "hardware.gpus": gpus,
            "parallel.strategy": strategy,
            "precision": precision or "amp-bf16",
        }
        if attention:
            settings["memory.attention"] = attention
        if mode == "lora":
            settings["lora.target_modules"] = targets(preset).split(",")
        name = f"bench:{preset}:{mode}:b{micro}:s{seq}:ac{int(ac)}:{gpus}:{strategy}"
        name += "".join(f":{x}" for x in extra_settings if x)
        out[name] = {"settings": settings}
    base = {"model.source": "Llama-3.1-8B", "batch.seq_len": 2048, "batch.micro_batch_size": 2}
    extra = {
        "zero1-adamw8bit": {"parallel.strategy": "zero1", "optim.name": "adamw-8bit", "hardware.gpus": "4xA100-80GB"},
        "zero2-fp16": {"parallel.strategy": "zero2", "precision": "amp-fp16", "hardware.gpus": "4xV100-32GB"},
        "fsdp-grad-op-accum": {
            "parallel.strategy": "fsdp-grad-op",
            "batch.grad_accum_steps": 4,
            "hardware.gpus": "8xH100-80GB",
        },
        "tp2-pp2": {"parallel.tp": 2, "parallel.pp": 2, "hardware.gpus": "8xH100-80GB", "precision": "bf16"},
        "offload-sgd": {"parallel.offload_optimizer": True, "optim.name": "sgd-momentum", "hardware.gpus": "A100-80GB"},
        "adafactor-eager": {"optim.name": "adafactor", "memory.attention": "eager", "hardware.gpus": "H100-80GB"},
        "hetero-lora": {"mode": "lora", "hardware.gpus": "A100-80GB,RTX4090", "precision": "amp-fp16"},
        "qlora-zero3": {"mode": "qlora", "parallel.strategy": "zero3", "hardware.gpus": "2xRTX4090"},
        "mixtral-full-tp": {
            "model.source": "Mixtral-8x7B",
            "parallel.tp": 8,
            "hardware.gpus": "8xH200-141GB",
            "precision": "bf16",
        },
        "gpt2-pp-unfused": {
            "model.source": "GPT-2",
            "batch.seq_len": 1024,
            "parallel.pp": 2,
            "train.fused_loss": False,
            "hardware.gpus": "2xT4",
            "precision": "amp-fp16",
        },
    }
    extra |= {  # branches the cases above leave out
        "pp-accum-lora-ac": {
            "mode": "lora",
            "parallel.pp": 2,
            "batch.grad_accum_steps": 4,
            "memory.activation_checkpointing": True,
            "hardware.gpus": "2xA100-80GB",
        },
        "zero1-lora": {"mode": "lora", "parallel.strategy": "zero1", "hardware.gpus": "4xA100-80GB"},
        "zero2-lora": {"mode": "lora", "parallel.strategy": "zero2", "hardware.gpus": "4xA100-80GB"},
        "fsdp-grad-op-lora": {"mode": "lora", "parallel.strategy": "fsdp-grad-op", "hardware.gpus": "4xA100-80GB"},
        "tp-lora": {"mode": "lora", "parallel.tp": 2, "hardware.gpus": "2xH100-80GB"},
        "tp-zero3": {"parallel.tp": 2, "parallel.strategy": "zero3", "hardware.gpus": "8xH100-80GB"},
        "offload-lora-dp": {
            "mode": "lora",
            "parallel.offload_optimizer": True,
            "hardware.gpus": "2xL4",
            "precision": "amp-bf16",
        },
        "inference-tp-pp": {"mode": "inference", "parallel.tp": 2, "parallel.pp": 2, "hardware.gpus": "4xL4"},
        "sgd-fused-accum": {
            "optim.name": "sgd",
            "optim.implementation": "fused",
            "batch.grad_accum_steps": 2,
            "hardware.gpus": "H100-80GB",
        },
        "zero3-one-layer-stage": {
            "model.source": "GPT-2",
            "batch.seq_len": 1024,
            "parallel.pp": 12,
            "parallel.strategy": "zero3",
            "hardware.gpus": "24xT4",
            "precision": "amp-fp16",
        },
        "gpt2-tp-rowwise-bias": {
            "model.source": "GPT-2",
            "batch.seq_len": 1024,
            "parallel.tp": 2,
            "hardware.gpus": "2xT4",
            "precision": "amp-fp16",
        },
    }
    for name, settings in extra.items():
        out[f"extra:{name}"] = {"settings": {**base, **settings}}
    return out


def render(case: dict) -> str:
    try:
        cfg = C.load(case.get("config"), [], case["settings"])
        text = json.dumps(plan(cfg).to_json(), indent=1, sort_keys=True)
    except TrainplanError as e:  # a refusal is an outcome too, and pinned like one
        return f"error: {e}"
    return text.replace(str(default_gguf_path()), "<embedded default GGUF>")  # where the venv is varies


# The host's memory where the snapshots were taken: the CPU device's and the offload host's capacity
# read /proc/meminfo, which differs by a few pages from one machine (or boot) to the next.
SNAPSHOT_HOST_BYTES = 25_276_502_016


def test_plan_json_is_byte_identical_to_the_snapshots(monkeypatch):
    from trainplan.plan import offload
    from trainplan.spec import devices

    for module in (offload, devices):
        monkeypatch.setattr(module, "host_memory_bytes", lambda: SNAPSHOT_HOST_BYTES)
    got = {name: render(case) for name, case in cases().items()}
    if os.environ.get("TRAINPLAN_UPDATE_SNAPSHOTS"):
        SNAPSHOTS.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
        pytest.skip("snapshots rewritten")
    want = json.loads(SNAPSHOTS.read_text())
    assert sorted(got) == sorted(want), "the set of snapshot cases changed: regenerate deliberately"
    changed = [name for name in want if got[name] != want[name]]
    assert not changed, f"plan --json changed for {len(changed)} case(s), first {changed[:3]}"
    assert sum(not v.startswith("error:") for v in got.values()) >= len(got) - 3  # the cases really plan
