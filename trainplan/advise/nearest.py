"""The nearest change that fits: what `plan` prints under a TIGHT or DOES NOT FIT verdict.

The memory ladder's rungs, as one or two settings on top of the user's own config, least intrusive
first: activation checkpointing, micro-batch 1 (the global batch kept by accumulation), ZeRO-3/FSDP,
the optimizer's states on the host, 8-bit AdamW, LoRA, then QLoRA. Each candidate is re-planned with the
same planner and verdict, and must be one `trainplan train` runs. The first that FITS is the answer;
two rungs are tried only when no single one fits, three only when no two do. Bounded in time:
`trainplan advise` is the search that explores further, and the answer names its command line.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from trainplan import config as C
from trainplan import features
from trainplan.errors import ConfigError
from trainplan.plan.analytic import plan
from trainplan.plan.ledger import Ledger, gib
from trainplan.plan.verdict import FITS
from trainplan.resolve import Resolved, resolve

TIME_BUDGET_S = 0.5


@dataclass(frozen=True)
class Step:
    label: str
    applies: Callable[[Resolved], bool]
    settings: Callable[[Resolved], dict]


def _training(r: Resolved) -> bool:
    return r.cfg.mode != "inference"


STEPS = (
    Step(
        "activation checkpointing",
        lambda r: _training(r) and r.cfg.memory.activation_checkpointing in (False, 0),
        lambda r: {"memory.activation_checkpointing": True},
    ),
    Step(
        "micro-batch 1",
        lambda r: r.batch.micro_batch_size > 1,
        lambda r: {
            "batch.micro_batch_size": 1,
            "batch.grad_accum_steps": r.batch.grad_accum_steps * r.batch.micro_batch_size,
        },
    ),
    Step(
        "ZeRO-3/FSDP",
        lambda r: _training(r) and r.dims.dp > 1 and r.dims.strategy != "zero3",
        lambda r: {"parallel.strategy": "zero3"},
    ),
    Step(
        "optimizer states on the host",
        lambda r: _training(r) and not features.optimizer_offload.on(r.cfg),
        lambda r: {"parallel.strategy": "zero3", "parallel.offload_optimizer": True},
    ),
    Step(
        "8-bit AdamW",
        lambda r: r.cfg.mode == "full" and not features.optim8bit.on(r.cfg),
        lambda r: {"optim.name": features.optim8bit.NAME},
    ),
    Step("LoRA", lambda r: r.cfg.mode == "full", lambda r: {"mode": "lora"}),
    Step(
        "QLoRA",
        lambda r: r.cfg.mode in ("full", "lora") and all(d.is_gpu for d in r.devices),
        lambda r: {"mode": features.qlora.MODE},
    ),
)


@dataclass(frozen=True)
class NextStep:
    settings: dict  # dotted key -> value, on top of the user's config
    labels: tuple[str, ...]
    ledger: Ledger  # the re-planned bill: FITS

    def set_flags(self) -> str:
        return " ".join(f"--set {shlex.quote(f'{k}={C.toml_literal(v)}')}" for k, v in self.settings.items())

    def to_json(self) -> dict:
        d = min(self.ledger.all_ledgers, key=lambda x: x.headroom_bytes)
        return {
            "settings": self.settings,
            "labels": list(self.labels),
            "state": self.ledger.state,
            "least_headroom_bytes": d.headroom_bytes,
            "device": d.label,
        }


def with_settings(cfg: C.RunConfig, settings: dict) -> C.RunConfig:
    """cfg with dotted settings on top, checked as --set checks them."""
    tree = cfg.to_dict()
    for dotted, value in settings.items():
        C._set_dotted(tree, dotted, value)
    return C.from_dict(tree)


def nearest(cfg: C.RunConfig, *, budget_s: float = TIME_BUDGET_S) -> NextStep | None:
    """The first rung (one, then two, then three together) whose re-planned bill FITS and that train
    runs; None when none does within the time budget."""
    r = resolve(cfg)
    steps = [s for s in STEPS if s.applies(r)]
    deadline = time.perf_counter() + budget_s
    for size in (1, 2, 3):
        for combo in combinations(steps, size):
            if time.perf_counter() > deadline:
                return None
            settings: dict = {}
            for step in combo:
                settings.update(step.settings(r))
            found = _try(cfg, settings)
            if found is not None:
                return NextStep(settings=settings, labels=tuple(s.label for s in combo), ledger=found)
    return None


def _try(cfg: C.RunConfig, settings: dict) -> Ledger | None:
    try:
        changed = with_settings(cfg, settings)
        ledger = plan(changed)
    except ConfigError:  # a combination the planner refuses (QLoRA's own rules, say)
        return None
    if ledger.state != FITS or not ledger.runnable["ok"]:
        return None
    return ledger


def advise_command(cfg: C.RunConfig) -> str:
    """The `trainplan advise` command line that searches the whole ladder for this job."""
    b = cfg.batch
    argv = ["trainplan", "advise", str(cfg.model.source), "--gpus", str(cfg.hardware.gpus), "--seq", str(b.seq_len)]
    if cfg.hardware.gpu_mem:
        argv += ["--gpu-mem", str(cfg.hardware.gpu_mem)]
    return shlex.join(argv)


def text(step: NextStep | None, cfg: C.RunConfig) -> str:
    """The lines printed under the verdict."""
    explore = f"Explore the whole ladder: {advise_command(cfg)}"
    if step is None:
        return f"Next step: no one, two or three rungs of the memory ladder fit. {explore}"
    d = min(step.ledger.all_ledgers, key=lambda x: x.headroom_bytes)
    return (
        f"Next step: {' + '.join(step.labels)}: {step.set_flags()} (re-planned: FITS, least headroom "
        f"{gib(d.headroom_bytes)} on {d.label} after its margin). {explore}"
    )
