"""The one training loop: set up, evaluate, step, evaluate, check the contract, record.

`trainplan train CONFIG.toml` runs it in one process; `torchrun --nproc_per_node N -m trainplan
train CONFIG.toml` runs it on N ranks (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.resolve import require_runnable, resolve
from trainplan.run import checkpoint, contract, data, dist, evaluate, guard, measure, models, step


def _device_label(env: dist.DistEnv) -> str:
    if env.device.type == "cuda":
        gib = torch.cuda.get_device_properties(env.device).total_memory / 2**30
        return f"{env.world}x{gib:.0f}GiB"
    return f"{env.world}xcpu" if env.world > 1 else "cpu"


def _schedule(cfg: C.TrainConfig):
    def factor(i: int) -> float:
        if i < cfg.warmup_steps:
            return (i + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "cosine":
            progress = (i - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _peak_memory(env: dist.DistEnv) -> dict:
    if env.device.type == "cuda":
        out = {
            "max_allocated_bytes": torch.cuda.max_memory_allocated(env.device),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(env.device),
        }
        torch.cuda.reset_peak_memory_stats(env.device)
        return out
    return {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


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


def prepare(cfg: C.RunConfig, env: dist.DistEnv):
    """Resolve the config for the devices actually present, then build data and model."""
    cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, gpus=_device_label(env)))
    r = resolve(cfg)
    directory = models.weights_dir(cfg) if models.is_pretrained(cfg) else None
    if directory is not None:  # build from the checkpoint's own transformers config, every field of it
        full_config = json.loads((directory / "config.json").read_text())
        r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, config=full_config))
    sharded = r.dims.shards_params and env.world > 1
    require_runnable(cfg, max_positions=r.spec.max_position_embeddings, sharded=sharded, cuda=env.device.type == "cuda")
    torch.manual_seed(cfg.train.seed)
    tokenizer = models.load_tokenizer(cfg, r.spec)
    docs = data.load_documents(cfg.data.source)
    train_docs, eval_docs = data.split_documents(docs, cfg.data.eval_fraction)
    seq = r.batch.seq_len
    train_ids, train_labels = data.pack(train_docs, tokenizer, seq, r.spec.vocab_size)
    eval_ids, eval_labels = data.pack(eval_docs, tokenizer, seq, r.spec.vocab_size)
    mesh = dist.mesh(env) if sharded else None
    model = models.load_model(cfg, r.spec, r.precision, env.device, dims=r.dims if mesh else None, mesh=mesh)
    return cfg, r, tokenizer, (train_docs, eval_docs), (train_ids, train_labels), (eval_ids, eval_labels), model


def run(cfg: C.RunConfig, *, quiet: bool = False, register: bool = True) -> dict:
    """Run the job described by cfg; returns the run record (also written to train.output_dir).

    register: add the run to the run registry (trainplan/registry.py)."""
    env = dist.init()
    t_start = time.perf_counter()
    cfg, r, tokenizer, (train_docs, eval_docs), (train_ids, train_labels), (eval_ids, eval_labels), model = prepare(
        cfg, env
    )
    prec, batch, mode = r.precision, r.batch, cfg.mode
    out_dir = Path(cfg.train.output_dir)
    model = dist.wrap(model, r.dims.strategy, env) if mode != "inference" else model
    before_params = contract.snapshot(model)
    all_reduce = env.all_reduce_sum if env.world > 1 else None

    def run_eval():
        return evaluate.evaluate(
            model,
            eval_ids,
            eval_labels,
            micro_batch=batch.micro_batch_size,
            max_batches=cfg.train.eval_batches,
            prec=prec,
            device=env.device,
            all_reduce=all_reduce,
            training_run=mode != "inference",
        )

    record = {
        "schema": "trainplan.run/1",
        "config": cfg.to_dict(),
        "versions": versions(cfg.mode),
        "hardware": {"device": str(env.device), "world_size": env.world, "devices": _device_label(env)},
        "seed": cfg.train.seed,
        "data": {
            "source": cfg.data.source,
            "fingerprint": data.fingerprint(train_docs + eval_docs),
            "train_documents": len(train_docs),
            "eval_documents": len(eval_docs),
            "train_sequences": int(train_ids.shape[0]),
            "eval_sequences": int(eval_ids.shape[0]),
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
    record["eval_before"] = run_eval()
    optimizer = None
    if mode == "inference":
        if cfg.train.measure_memory:  # one real forward, as the plan's inference phase
            mb = {"input_ids": eval_ids[: batch.micro_batch_size].to(env.device)}
            mb["labels"] = eval_labels[: batch.micro_batch_size].to(env.device)
            meter = measure.StepMeter(model, None, list(mb.values()), env.device, lora=False)
            with meter:
                step.eval_forward(model, mb, prec=prec, device_type=env.device.type, on_phase=meter.on_phase)
            record["memory"] = {"step": 0, "per_rank": env.gather(meter.result())}
        record["generation"] = _generate(model, tokenizer, env)
    else:
        optimizer = step.build_optimizer(
            model,
            cfg.optim.name,
            cfg.optim.implementation,
            cfg.optim.lr,
            cfg.optim.weight_decay,
            env.device.type,
            zero1=r.dims.strategy == "zero1",
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg.train))
        scaler = torch.amp.GradScaler(env.device.type) if prec.loss_scaling else None
        sampler = data.StatefulSampler(train_ids.shape[0], seed=cfg.train.seed, rank=env.rank, world=env.world)
        ckpt = _Checkpoints(cfg, out_dir, env, r)
        sentinel = guard.Guard(cfg.guard, scaler=scaler is not None)
        start, tokens_seen = ckpt.maybe_resume(model, optimizer, scheduler, scaler, sampler, record, sentinel)
        fixed = [sampler.take(batch.micro_batch_size) for _ in range(cfg.train.overfit_batches)]
        measure_at = (start + 1 if cfg.train.steps - start >= 2 else start) if cfg.train.measure_memory else -1
        injections = cfg.guard.injections()
        record["guard"] = {"events": sentinel.events, "settings": dataclasses.asdict(cfg.guard)}
        t_train = time.perf_counter()
        i = start
        while i < cfg.train.steps:
            t0 = time.perf_counter()
            micro, ids = [], []
            for j in range(batch.grad_accum_steps):
                idx = fixed[j % len(fixed)] if fixed else sampler.take(batch.micro_batch_size)
                ids += idx
                micro.append({"input_ids": train_ids[idx].to(env.device), "labels": train_labels[idx].to(env.device)})
            local_tokens = sum(step.target_tokens(mb) for mb in micro)
            tokens = int(env.all_reduce_sum(torch.tensor(float(local_tokens)))) if env.world > 1 else local_tokens
            lr = scheduler.get_last_lr()[0]
            meter = None
            if i == measure_at:
                inputs = [t for mb in micro for t in mb.values()]
                meter = measure.StepMeter(model, optimizer, inputs, env.device, lora=mode in ("lora", "qlora"))
            verdict: dict = {}

            def decide(loss_t, norm_t, scale, i=i, verdict=verdict, ids=ids):
                """Every rank reaches the same decision: the values are global, and the action is
                reduced across ranks too, so no rank steps while another skips."""
                loss_v = float(env.all_reduce_sum(loss_t.float().cpu())) if env.world > 1 else float(loss_t)
                norm_v = float(norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t)
                event = sentinel.check(i + 1, loss_v, norm_v, scale)
                code = torch.tensor(float(guard.ACTIONS.index(event["action"]) + 1 if event else 0))
                code = int(env.all_reduce_max(code)) if env.world > 1 else int(code)
                if code and event is None:  # another rank saw it
                    event = {"step": i + 1, "kind": "remote", "key": "-", "value": float("nan")}
                if code:  # the most severe action of any rank, on every rank
                    event["action"] = guard.ACTIONS[code - 1]
                sentinel.observe(loss_v, norm_v)
                if event is not None:
                    event["batch_ids"] = env.gather(ids)
                verdict.update(loss=loss_v, event=event)
                return event is None

            with meter or contextlib.nullcontext():
                res = step.train_step(
                    model,
                    optimizer,
                    micro,
                    prec=prec,
                    device_type=env.device.type,
                    scaler=scaler,
                    max_grad_norm=cfg.train.max_grad_norm,
                    token_count=tokens,
                    grad_scale=float(env.world),
                    scheduler=scheduler,
                    on_phase=meter.on_phase if meter else lambda phase: None,
                    decide=decide,
                    inject=injections.pop(i + 1, ()),  # one-shot: a rolled-back step runs clean
                )
            if meter is not None:
                record["memory"] = {"step": i + 1, "per_rank": env.gather(meter.result())}
            loss = verdict["loss"]
            norm = res.grad_norm.full_tensor() if hasattr(res.grad_norm, "full_tensor") else res.grad_norm
            dt = time.perf_counter() - t0
            entry = {
                "step": i + 1,
                "loss": loss,
                "grad_norm": float(norm),
                "lr": lr,
                "tokens": tokens,
                "tokens_per_s": tokens / dt,
                "seconds": dt,
                "memory": _peak_memory(env),
            }
            if not res.applied:
                entry["skipped"] = True
            record["steps"].append(entry)
            tokens_seen += tokens
            event = verdict["event"]
            if event is not None:
                sentinel.events.append(event)
                if env.is_main:
                    print(
                        f"trainplan train: guard: step {event['step']} {event['key']} {event['kind']} "
                        f"({event['value']:.4g}) -> {event['action']}",
                        file=sys.stderr,
                    )
                if event["action"] == "rollback":
                    restored = ckpt.rollback(model, optimizer, scheduler, scaler, sampler, sentinel, event)
                    if restored is not None:
                        i, tokens_seen = restored
                        continue
                if event["action"] == "stop":
                    ckpt.save(i + 1, model, optimizer, scheduler, scaler, sampler, tokens_seen, sentinel, force=True)
                    record["stopped"] = event
                    i += 1
                    break
            if cfg.train.eval_every and (i + 1) % cfg.train.eval_every == 0 and i + 1 < cfg.train.steps:
                entry["eval"] = run_eval()
            if cfg.checkpoint.every and (i + 1) % cfg.checkpoint.every == 0:
                ckpt.save(i + 1, model, optimizer, scheduler, scaler, sampler, tokens_seen, sentinel)
            if not quiet and env.is_main and sys.stderr.isatty():
                mem = entry["memory"].get("max_allocated_bytes", entry["memory"].get("max_rss_bytes", 0)) / 2**30
                sys.stderr.write(
                    f"\r[{'#' * int(20 * (i + 1) / cfg.train.steps):20s}] step {i + 1}/"
                    f"{cfg.train.steps} loss {loss:.4f} {entry['tokens_per_s']:.0f} tok/s {mem:.1f} GiB"
                )
            i += 1
            if cfg.train.stop_after and i >= cfg.train.stop_after:
                break
        if not quiet and env.is_main and sys.stderr.isatty():
            sys.stderr.write("\n")
        record["train_seconds"] = time.perf_counter() - t_train
        record["sampler"] = sampler.state_dict()
        record["final"] = _fingerprints(model, optimizer, scheduler, sampler, batch)
    record["eval_after"] = run_eval()
    record["contract"] = contract.check(mode, model, before_params, optimizer=optimizer).to_json()
    record["wall_seconds"] = time.perf_counter() - t_start
    if env.is_main:
        from trainplan.cli import write_atomic

        if register:
            _register(record, env)
        write_atomic(out_dir / "record.json", json.dumps(record, indent=1))
    record["_env"] = env
    return record


def device_name(env: dist.DistEnv) -> str:
    return torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"


def _register(record: dict, env: dist.DistEnv) -> None:
    from trainplan import registry

    verdict = "PASS" if record["contract"]["passed"] else "FAIL"
    try:
        record["registry_id"] = registry.add(
            registry.row_from_record(record, kind="train", verdict=verdict, device=device_name(env))
        )
    except Exception as e:  # the run itself succeeded; a registry that cannot be written is a warning
        print(f"trainplan train: warning: run not registered ({type(e).__name__}: {e})", file=sys.stderr)


def _generate(model, tokenizer, env: dist.DistEnv, prompt: str = "def fibonacci(n):", tokens: int = 16) -> dict:
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(env.device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return {"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)}


FINGERPRINT_LIMIT = 4 << 30  # hashing gathers every trainable tensor on every rank: small runs only


def _state_hashes(model, optimizer) -> dict:
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


def _fingerprints(model, optimizer, scheduler, sampler: data.StatefulSampler, batch) -> dict:
    """What a resumed run must reproduce: weights, optimizer state, and the next batch's samples."""
    import copy

    upcoming = copy.deepcopy(sampler).take(batch.micro_batch_size * batch.grad_accum_steps)
    return {**_state_hashes(model, optimizer), "next_batch": upcoming, "scheduler_step": scheduler.last_epoch}


class _Checkpoints:
    """Checkpoint policy for one run: where, how often, and resuming."""

    def __init__(self, cfg: C.RunConfig, out_dir: Path, env: dist.DistEnv, r) -> None:
        self.cfg, self.env, self.batch = cfg, env, r.batch
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
        # FSDP2 strategies write DCP shards, readable at any world size (one process included)
        self.sharded = cfg.parallel.strategy in ("zero3", "fsdp-grad-op")
        self.last: Path | None = None  # the newest checkpoint of this run (written or resumed from)
        self.expect = {
            "model_fingerprint": _model_fingerprint(r.spec, cfg),
            "mode": cfg.mode,
            "compat": _compat(cfg, r),
        }

    def save(
        self, step_no, model, optimizer, scheduler, scaler, sampler, tokens_seen, sentinel, *, force=False
    ) -> None:
        """force: the guard stopped the run; keep a checkpoint even when checkpoint.every is 0."""
        if not (self.cfg.checkpoint.every or force):
            return
        state = {
            **self.expect,
            "step": step_no,
            "tokens_seen": tokens_seen,
            "sampler": sampler.state_dict(),
            "guard": sentinel.state_dict(),
            "config": self.cfg.to_dict(),
        }
        self.last = checkpoint.save(
            self.root,
            step=step_no,
            model=getattr(model, "module", model),
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            state=state,
            keep_last=self.cfg.checkpoint.keep_last,
            sharded=self.sharded,
        )

    def _load(self, path: Path, model, optimizer, scheduler, scaler, sampler) -> dict:
        state = checkpoint.load(
            path,
            model=getattr(model, "module", model),
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            expect=self.expect,
            sharded=self.sharded,
        )
        sampler.load_state_dict(state["sampler"])
        return state

    def rollback(self, model, optimizer, scheduler, scaler, sampler, sentinel, event) -> tuple[int, int] | None:
        """Restore the newest valid checkpoint, skip the next `guard.rollback_skip` steps' batches,
        optionally lower the LR. Returns (step, tokens seen) to continue from, or None when the
        event's action changed (no checkpoint: skip; too many rollbacks: stop)."""
        g = self.cfg.guard
        if sentinel.rollbacks >= g.max_rollbacks:
            event["action"] = "stop"
            event["note"] = f"{sentinel.rollbacks} rollback(s) already (guard.max_rollbacks): stopping"
            return None
        path = self.last  # never another run's checkpoint that happens to share the directory
        if path is None or checkpoint.validate(path) is not None:
            event["action"] = "skip"
            event["note"] = "no valid checkpoint of this run to roll back to: the step was skipped instead"
            return None
        state = self._load(path, model, optimizer, scheduler, scaler, sampler)
        count = sentinel.rollbacks + 1
        if "guard" in state:
            sentinel.load_state_dict(state["guard"])
        sentinel.rollbacks = count
        # As PaLM did: skip the batches seen between the checkpoint and the bad step, that one
        # included, plus guard.rollback_skip more after it.
        per_step = self.batch.micro_batch_size * self.batch.grad_accum_steps
        steps = event["step"] - state["step"] + g.rollback_skip
        skipped = [i for _ in range(steps) for i in sampler.take(per_step)]
        if g.rollback_lr_factor != 1.0:
            scheduler.base_lrs = [b * g.rollback_lr_factor for b in scheduler.base_lrs]
            for group in optimizer.param_groups:
                group["lr"] *= g.rollback_lr_factor
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        event.update(
            restored_from=path.name,
            restored_step=state["step"],
            skipped_batch_ids=self.env.gather(skipped),
            lr_factor=g.rollback_lr_factor,
        )
        return state["step"], state["tokens_seen"]

    def maybe_resume(self, model, optimizer, scheduler, scaler, sampler, record, sentinel) -> tuple[int, int]:
        resume = self.cfg.checkpoint.resume
        if not resume:
            return 0, 0
        if resume == "auto":
            path, skipped = checkpoint.latest_valid(self.root)
            for name, reason in skipped if self.env.is_main else []:
                print(f"trainplan train: skipped checkpoint {name}: {reason}", file=sys.stderr)
            record["resume"] = {"skipped": [{"checkpoint": n, "reason": why} for n, why in skipped]}
            if path is None:
                record["resume"]["from"] = None
                return 0, 0
        else:
            path = Path(resume)
            if not path.is_dir():
                raise ConfigError(
                    "checkpoint.resume", f"no checkpoint at {resume!r}", 'give a step-NNNNNNNN directory or "auto"'
                )
            record["resume"] = {"skipped": []}
        state = self._load(path, model, optimizer, scheduler, scaler, sampler)
        if "guard" in state:
            sentinel.load_state_dict(state["guard"])
        record["resume"]["loaded"] = _state_hashes(model, optimizer)
        for note in state["notes"]:
            if self.env.is_main:
                print(f"trainplan train: resume: {note}", file=sys.stderr)
        record["resume"]["notes"] = state["notes"]
        record["resume"]["from"] = str(path)
        self.last = path
        record["resume"]["step"] = state["step"]
        return state["step"], state["tokens_seen"]


def _model_fingerprint(spec, cfg: C.RunConfig) -> str:
    import hashlib

    blob = json.dumps({"config": spec.config, "source": cfg.model.source, "init": cfg.model.init}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _compat(cfg: C.RunConfig, r) -> str:
    """Settings a resumed run must share with the run that wrote the checkpoint. The global batch,
    not its split into ranks x micro-batch x accumulation, so a run can resume on another world size."""
    import hashlib

    d = cfg.to_dict()
    keep = {
        "precision": d["precision"],
        "lora": d["lora"],
        "optim": d["optim"],
        "data": d["data"],
        "seed": d["train"]["seed"],
        "seq_len": r.batch.seq_len,
        "global_batch_size": r.batch.global_batch_size,
    }
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
