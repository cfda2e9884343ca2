"""The run record: what a run did, with its settings, figures and evidence.

`loop.run` returns it; the caller (the train command, accept) writes it as record.json and
registers it. accept's checks, the reports and the registry read it (schema trainplan.run/1).
"""

from __future__ import annotations

import copy
import json
import platform
from pathlib import Path

import torch

from trainplan.files import write_atomic
from trainplan.run import checkpoint, data, dist, measure

SCHEMA = "trainplan.run/1"
FILE = "record.json"
FINGERPRINT_LIMIT = 4 << 30  # hashing gathers every trainable tensor on every rank: small runs only


def write(record: dict, out_dir: Path) -> Path:
    """record.json in out_dir, atomically."""
    path = Path(out_dir) / FILE
    write_atomic(path, json.dumps(record, indent=1))
    return path


def versions(mode: str = "full") -> dict:
    import peft
    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    if mode == "qlora":  # its base weights are bitsandbytes' NF4 kernels' business
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


def header(job) -> dict:
    """The record before the run: config, versions, hardware, data and model (a setup.Job)."""
    cfg, r, env = job.cfg, job.resolved, job.env
    batch = r.batch
    return {
        "schema": SCHEMA,
        "config": cfg.to_dict(),
        "versions": versions(cfg.mode),
        "hardware": {"device": str(env.device), "world_size": env.world, "devices": device_label(env)},
        "seed": cfg.train.seed,
        "data": {
            "source": cfg.data.source,
            "fingerprint": data.fingerprint(job.train.documents + job.eval.documents),
            "train_documents": len(job.train.documents),
            "eval_documents": len(job.eval.documents),
            "train_sequences": int(job.train.ids.shape[0]),
            "eval_sequences": int(job.eval.ids.shape[0]),
        },
        "model": r.spec.summary(),
        "batch": {
            "micro_batch_size": batch.micro_batch_size,
            "grad_accum_steps": batch.grad_accum_steps,
            "global": batch.global_batch_size,
            "seq_len": batch.seq_len,
        },
        "steps": [],
    }


def state_hashes(model, optimizer) -> dict:
    """Hashes of the whole trainable weights and optimizer state, independent of the sharding."""
    base = getattr(model, "module", model)
    size = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    if size > FINGERPRINT_LIMIT:
        return {"weights_hash": None, "optimizer_hash": None}
    opt_hash = None if hasattr(optimizer, "consolidate_state_dict") else checkpoint.optimizer_hash(optimizer)
    return {
        "weights_hash": checkpoint.tensor_hash(sorted(checkpoint.trainable_state(base).items())),
        "optimizer_hash": opt_hash,
    }


def fingerprints(model, state, batch) -> dict:
    """What a resumed run must reproduce: weights, optimizer state, and the next batch's samples."""
    upcoming = copy.deepcopy(state.sampler).take(batch.micro_batch_size * batch.grad_accum_steps)
    return {
        **state_hashes(model, state.optimizer),
        "next_batch": upcoming,
        "scheduler_step": state.scheduler.last_epoch,
    }
