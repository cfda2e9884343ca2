"""The run record: what a run did, with its settings, figures and evidence.

`loop.run` returns it; the caller (the train command, accept) writes it as record.json and
registers it. accept's checks, the reports and the registry read it (schema trainplan.run/1).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainplan import _torch_private
from trainplan.features import qlora
from trainplan.files import write_atomic
from trainplan.run import checkpoint, data, dist, measure

SCHEMA = "trainplan.run/1"
FILE = "record.json"
FINGERPRINT_LIMIT = 4 << 30  # hashing gathers every trainable tensor on every rank: small runs only


@dataclass(kw_only=True)
class RunRecord:
    """What a run did: its settings, per-step history, held-out metric before and after, the mode
    contract and the measured memory. The typed contract that accept's checks, the reports and the
    registry read; record.json is its `to_json()`. Nested sections stay JSON objects, described
    in docs/acceptance.md."""

    schema: str = SCHEMA
    config: dict  # RunConfig.to_dict(), with the devices actually present
    versions: dict
    hardware: dict  # device, world_size, devices
    seed: int
    data: dict  # source, fingerprint, documents and sequences per split
    model: dict  # ModelSpec.summary()
    batch: dict  # micro_batch_size, grad_accum_steps, global, seq_len
    # per step: step, loss, grad_norm, lr, tokens, tokens_per_s, seconds, memory; and "eval" (the
    # held-out metric) on every train.eval_every-th step
    steps: list[dict] = field(default_factory=list)
    eval_before: dict | None = None  # loss, perplexity, token_accuracy, tokens
    eval_after: dict | None = None
    contract: dict | None = None  # mode, passed, detail
    # The run's one duration ("run wall time"): process-group start to the record's conclusion
    # (load, evaluations, steps, save). The reports, `trainplan runs` and accept's verdict line show it.
    wall_seconds: float | None = None
    train_seconds: float | None = None  # the training steps alone, a part of wall_seconds
    compile: dict | None = None  # train.compile: backend, regions, seconds (run/loop.py compile_time)
    memory: dict | None = None  # the measured step: {"step", "per_rank": [StepMeter.result()]}
    # train.largest_batch_first: the widest micro-batch's forward and backward, run after step 1 and
    # undone: {"after_step", "shape", "per_rank": [measured peak bytes]}
    largest_batch_probe: dict | None = None
    # the advisor's step-time estimate for this run's config and devices against the measured steps
    # (commands/train.py time_vs_estimate): {"estimated_step_seconds", "measured_step_seconds", ...}
    time_estimate: dict | None = None
    phase_memory: dict | None = None  # the run around the step: {"per_rank": [{"device", "load", "evaluate", "save"}]}
    generation: dict | None = None  # inference: prompt and completion
    # accept: greedy completions of held-out prompts by the base and the result, [{prompt, before, after}]
    samples: list[dict] | None = None
    resume: dict | None = None  # what was resumed from, and what was skipped
    guard: dict | None = None  # the guard's settings and the events it acted on
    stopped: dict | None = None  # the event that stopped the run
    sampler: dict | None = None  # the data position at the end
    # sample ids (rows of the packed training set) the run left out after rollbacks, each once, in the
    # order skipped; a resumed run's include its checkpoint's. Each rollback event lists its own
    # (guard.events: skipped_ids) and the step entries it undid (replaced_steps); a step in `steps`
    # ran once, or is its replay ("replayed": how many of its runs were rolled back).
    skipped_samples: list[int] | None = None
    final: dict | None = None  # weights / optimizer hashes and the next batch (verify-resume)
    result: dict | None = None  # where the trained model or adapter was saved, and in what format
    interrupted: dict | None = None  # SIGINT / SIGTERM: the signal and the step the run stopped after
    registry_id: int | None = None

    @property
    def mode(self) -> str:
        return self.config["mode"]

    @property
    def training(self) -> bool:
        return self.mode != "inference"

    @property
    def passed(self) -> bool:
        """The mode contract held (a run the guard stopped has passed=False elsewhere: see stopped)."""
        return bool(self.contract and self.contract["passed"])

    @property
    def guard_events(self) -> list[dict]:
        return (self.guard or {}).get("events", [])

    def to_json(self) -> dict:
        """record.json: every field that applies to this run (sections that do not are left out)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, doc: dict) -> RunRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


def write(record: RunRecord, out_dir: Path) -> Path:
    """record.json in out_dir, atomically."""
    path = Path(out_dir) / FILE
    write_atomic(path, json.dumps(record.to_json(), indent=1))
    return path


def read(out_dir: Path) -> RunRecord:
    return RunRecord.from_json(json.loads((Path(out_dir) / FILE).read_text()))


def versions(mode: str = "full") -> dict:
    """The versions that decide a run's numbers. Read from the installed packages' metadata: importing
    PEFT (and bitsandbytes under it) only for its version cost a full fine-tune's start a second."""
    from importlib.metadata import version

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "peft": version("peft"),
    }
    if mode == qlora.MODE:  # its base weights are bitsandbytes' NF4 kernels' business
        import bitsandbytes

        out["bitsandbytes"] = bitsandbytes.__version__
    return out


def device_label(env: dist.DistEnv) -> str:
    """The devices as `--gpus` would name them: 2x80GiB, 2xcpu, cpu."""
    if env.device.type == "cuda":
        gib = torch.cuda.get_device_properties(env.device).total_memory / 2**30
        return f"{env.world}x{gib:.0f}GiB"
    return f"{env.world}xcpu" if env.world > 1 else "cpu"


def device_name(env: dist.DistEnv) -> str:
    return torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"


def peak_memory(env: dist.DistEnv) -> dict:
    """The step's peak: the CUDA allocator's (then reset), or the process's RSS on the CPU."""
    if env.device.type == "cuda":
        out = {
            "max_allocated_bytes": torch.cuda.max_memory_allocated(env.device),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(env.device),
        }
        torch.cuda.reset_peak_memory_stats(env.device)
        return out
    return {"max_rss_bytes": measure.max_rss_bytes()}


def header(job) -> RunRecord:
    """The record before the run: config, versions, hardware, data and model (a setup.Job)."""
    cfg, r, env = job.cfg, job.resolved, job.env
    batch = r.batch
    return RunRecord(
        config=cfg.to_dict(),
        versions=versions(cfg.mode),
        hardware={
            "device": str(env.device),
            "world_size": env.world,
            "devices": device_label(env),
            "fsdp_offload": _torch_private.fsdp_offload_policy(job.model),  # as applied; None: not FSDP2
            # the CUDA caching allocator's settings in force (run/dist.py configure_cuda_allocator)
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if env.device.type == "cuda" else None,
        },
        seed=cfg.train.seed,
        data={
            "source": cfg.data.source,
            "fingerprint": data.fingerprint(job.train.documents + job.eval.documents),
            "train_documents": len(job.train.documents),
            "eval_documents": len(job.eval.documents),
            "train_sequences": int(job.train.ids.shape[0]),
            "eval_sequences": int(job.eval.ids.shape[0]),
            "packing": job.train.packing,
            "truncated_documents": job.train.truncated + job.eval.truncated,
            "packing_efficiency": round(job.train.efficiency, 4),
        },
        model=r.spec.summary(),
        batch={
            "micro_batch_size": batch.micro_batch_size,
            "grad_accum_steps": batch.grad_accum_steps,
            "global": batch.global_batch_size,
            "seq_len": batch.seq_len,
        },
    )


def as_run(model: torch.nn.Module, optimizer, compute_dtype: str) -> dict:
    """The layout and features the engine runs, read back from its own objects, not copied from the
    config: the process group's world, the wrapper (FSDP2, DDP, DDP with ZeroRedundancyOptimizer, or
    none), the dtypes the parameters hold, and the modules LoRA, QLoRA and checkpointing left."""
    from torch.nn.parallel import DistributedDataParallel

    reshards = _torch_private.fsdp_reshards_after_forward(model)
    if reshards is not None:
        strategy = "zero3" if reshards else "fsdp-grad-op"
    elif isinstance(model, DistributedDataParallel):
        strategy = "zero1" if hasattr(optimizer, "consolidate_state_dict") else "ddp"  # ZeroRedundancyOptimizer
    else:
        strategy = "single"
    base = getattr(model, "module", model)
    params = list(base.parameters())

    def dtypes(trainable: bool) -> list[str]:
        return sorted({str(p.dtype).removeprefix("torch.") for p in params if p.requires_grad is trainable})

    return {
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "strategy": strategy,
        "tp": _tp_degree(base),
        "fsdp_offload": _torch_private.fsdp_offload_policy(model),
        "compute_dtype": compute_dtype,
        "trainable_dtypes": dtypes(True),
        "frozen_dtypes": dtypes(False),
        "lora_modules": sum(1 for name, _ in base.named_modules() if name.endswith(".lora_A")),
        "quantized_4bit_modules": sum(1 for m in base.modules() if type(m).__name__ == "Linear4bit"),
        "checkpointed_layers": sum(1 for m in base.modules() if getattr(m, "gradient_checkpointing", None) is True),
    }


def _tp_degree(model: torch.nn.Module) -> int:
    """The tensor-parallel degree the decoder's projections are split over: the size of the "tp" axis
    of their DTensors' mesh (1 where none is split)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        if "tp" in names:
            return mesh.size(names.index("tp"))
    return 1


def state_hashes(model, optimizer, *, stages: tuple | None = None) -> dict:
    """Hashes of the whole trainable weights and optimizer state, independent of the sharding.

    stages: (env, dims) of pipeline stages, each holding its own tensors: the first replica's stages'
    hashes, hashed in stage order
    (a collective), so the hash covers the whole model; equal only on the same stage split."""
    base = getattr(model, "module", model)
    size = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    if size > FINGERPRINT_LIMIT:
        hashes = {"weights_hash": None, "optimizer_hash": None}
    else:
        opt_hash = None if hasattr(optimizer, "consolidate_state_dict") else checkpoint.optimizer_hash(optimizer)
        hashes = {
            "weights_hash": checkpoint.tensor_hash(sorted(checkpoint.trainable_state(base).items())),
            "optimizer_hash": opt_hash,
        }
    if stages is None:
        return hashes
    env, dims = stages
    every = [h for rank, h in enumerate(env.gather(hashes)) if dims.coords(rank)[1] == 0]  # (stage, replica 0)
    return {
        k: None
        if any(h[k] is None for h in every)
        else hashlib.sha256("|".join(h[k] for h in every).encode()).hexdigest()[:32]
        for k in hashes
    }


def fingerprints(model, state, batch, *, stages: tuple | None = None) -> dict:
    """What a resumed run must reproduce: weights, optimizer state, and the next batch's samples
    (stages: pipeline stages, `state_hashes`)."""
    upcoming = copy.deepcopy(state.sampler).take(batch.micro_batch_size * batch.grad_accum_steps)
    hashes = state_hashes(model, state.optimizer, stages=stages)
    return {
        **hashes,
        "next_batch": upcoming,
        "scheduler_step": state.scheduler.last_epoch,
    }
