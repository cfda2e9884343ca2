"""One run's checkpoint policy: where, how often, resume and rollback. Built once per run;
`format` is the only code that writes or reads the files."""

from __future__ import annotations

import copy
import json
import sys
import uuid
from pathlib import Path

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.files import read_json, short_hash, special
from trainplan.resolve import Resolved
from trainplan.run import dist
from trainplan.run.checkpoint import format as ckpt
from trainplan.run.record import state_hashes
from trainplan.spec.parallel import PARAM_SHARDING_STRATEGIES


def model_fingerprint(r: Resolved) -> str:
    """The model a checkpoint belongs to: its architecture, source and initialisation."""
    cfg = r.cfg
    return short_hash(
        json.dumps({"config": r.spec.config, "source": cfg.model.source, "init": cfg.model.init}, sort_keys=True)
    )


def compat(r: Resolved) -> str:
    """Settings a resumed run must share with the run that wrote the checkpoint. The global batch,
    not its split into ranks x micro-batch x accumulation, so a run can resume on another world size."""
    d = r.cfg.to_dict()
    keep = {
        "precision": d["precision"],
        "lora": d["lora"],
        "optim": d["optim"],
        "data": d["data"],
        "seed": d["train"]["seed"],
        "seq_len": r.batch.seq_len,
        "global_batch_size": r.batch.global_batch_size,
    }
    return short_hash(json.dumps(keep, sort_keys=True))


def expected(r: Resolved) -> dict:
    """What a checkpoint this run resumes must have been written for (checkpoint/format.py `refuse_other_run`)."""
    return {"model_fingerprint": model_fingerprint(r), "mode": r.cfg.mode, "compat": compat(r)}


def refuse_other_runs_checkpoint(r: Resolved) -> None:
    """checkpoint.resume naming another model's, mode's or config's checkpoint: refused as the run starts, before
    it writes anything (tensorboard, a tokenized cache), not after it has built its model. `r`: as built."""
    resume = r.cfg.checkpoint.resume
    if resume in ("", "auto"):
        return
    path = Path(resume)
    state = read_json(path / "state.json", "checkpoint.resume")  # refuse_unusable_resume validated the directory
    if isinstance(state, dict):
        ckpt.refuse_other_run(path, state, expected(r))


def checkpoint_root(cfg: C.RunConfig) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.output_dir) / "checkpoints"


def refuse_unusable_resume(cfg: C.RunConfig) -> None:
    """checkpoint.resume naming a directory: it must be a checkpoint, whole, before the run builds or
    writes anything (its checksums are verified where it loads)."""
    resume = cfg.checkpoint.resume
    if resume in ("", "auto"):
        return
    path = Path(resume)
    if not path.is_dir():
        what = special(path) or ("is a file" if path.exists() else None)
        raise ConfigError(
            "checkpoint.resume",
            f"{resume!r} {what}, not a checkpoint directory" if what else f"no checkpoint at {resume!r}",
            'give a step-NNNNNNNN directory or "auto"',
        )
    reason = ckpt.validate(path, sums=False)
    if reason is not None:
        raise ConfigError(
            "checkpoint.resume", f"{resume!r} is not a usable checkpoint: {reason}", 'give another one, or "auto"'
        )


def refuse_foreign(cfg: C.RunConfig) -> None:
    """A fresh run that writes checkpoints does not share a directory with another run's: its
    pruning, or a later resume = "auto", would mix the two runs."""
    if cfg.checkpoint.resume or not cfg.checkpoint.every:
        return
    root = checkpoint_root(cfg)
    others = ckpt.foreign(root, None)
    if others:
        owner = ckpt.run_id_of(others[0]) or "an earlier run"
        raise ConfigError(
            "checkpoint.dir",
            f"{str(root)!r} holds another run's checkpoints ({others[0].name}, run {owner})",
            'give this run its own --output-dir (or checkpoint.dir), or set checkpoint.resume = "auto" to '
            "continue that run",
        )


class CheckpointManager:
    """Checkpoints of one run. `last` is the newest checkpoint of this run (written or resumed
    from): rollback never restores another run's checkpoint that happens to share the directory."""

    def __init__(self, r: Resolved, env: dist.DistEnv, model) -> None:
        cfg = r.cfg
        self.cfg: C.RunConfig = cfg
        self.env, self.batch = env, r.batch
        self.model = getattr(model, "module", model)
        self.root = checkpoint_root(cfg)
        # FSDP2 strategies write DCP shards, readable at any world size. The configured strategy
        # decides, not this world's layout: a zero3 run on one process ("single") writes DCP too.
        # Tensor parallelism's DTensors too (DCP reads them back on another tp), and pipeline stages (each
        # writes its own tensors, under their whole-model names: DCP reads them back on another pp).
        self.staged, self.dims = r.dims.pp > 1, r.dims
        self.sharded = cfg.parallel.strategy in PARAM_SHARDING_STRATEGIES or r.dims.tp > 1 or self.staged
        self.last: Path | None = None
        self.last_step, self.last_sampler = 0, None  # the step and data position `last` holds
        self.rolled_back_to: Path | None = None  # the previous rollback's checkpoint
        self.expect = expected(r)
        # This run's lineage: a fresh id, or the id of the run it resumes (set by maybe_resume).
        # Pruning and rollback touch only this lineage's checkpoints.
        self.run_id = env.gather(uuid.uuid4().hex[:12])[0]  # rank 0's, on every rank
        if env.is_main:  # what dead writers left: interrupted removals, their temporary dirs
            ckpt.clean_leftovers(self.root)

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and step % every == 0

    def save(self, state, *, force: bool = False) -> None:
        """force: the guard stopped the run; keep a checkpoint even when checkpoint.every is 0."""
        if not (self.cfg.checkpoint.every or force):
            return
        self.last = ckpt.save(
            self.root,
            step=state.step,
            model=self.model,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            scaler=state.scaler,
            state={**self.expect, **state.state_dict(), "config": self.cfg.to_dict(), "run_id": self.run_id},
            keep_last=self.cfg.checkpoint.keep_last,
            sharded=self.sharded,
            kill=self._kill(state.step),
        )
        self.last_step, self.last_sampler = state.step, state.sampler.state_dict()

    def _kill(self, step: int) -> str | None:
        """Fault injection (tests only: run/faults.py is imported when guard.inject is set)."""
        if not self.cfg.guard.inject:
            return None
        from trainplan.run import faults

        return faults.kill_at(self.cfg.guard, step)

    def _load(self, path: Path, state) -> dict:
        saved = ckpt.load(
            path,
            model=self.model,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            scaler=state.scaler,
            expect=self.expect,
            sharded=self.sharded,
        )
        state.load_state_dict(saved)
        return saved

    def rollback(self, state, event: dict, *, sampled: bool = True) -> bool:
        """Restore the newest valid checkpoint of this run, skip the batches from it through the bad
        step plus `guard.rollback_skip` more, by sample id, optionally lower the LR. False when the
        event's action changed instead (no checkpoint: skip; too many rollbacks, or a second one to
        the same checkpoint with nothing new to skip: stop). `sampled`: the steps draw their batches
        from the sampler (not train.overfit_batches' fixed ones), so skipping changes the data."""
        g = self.cfg.guard
        rollbacks = state.guard.rollbacks
        if rollbacks >= g.max_rollbacks:
            event["action"] = "stop"
            event["note"] = f"{rollbacks} rollback(s) already (guard.max_rollbacks): stopping"
            return False
        path = self.last
        if path is None or ckpt.validate(path) is not None:
            event["action"] = "skip"
            event["note"] = "no valid checkpoint of this run to roll back to: the step was skipped instead"
            return False
        skipped = self._window(state.sampler, event["step"] + g.rollback_skip) if sampled else []
        if not skipped and path == self.rolled_back_to:
            event["action"] = "stop"
            event["note"] = (
                f"rolled back to {path.name} before, and nothing new to skip since: the replay would train on "
                "the same data again; stopping"
            )
            return False
        self._load(path, state)  # the sampler keeps its skipped ids (loading adds to them)
        state.sampler.skip(skipped)
        state.guard.rollbacks = rollbacks + 1
        self.rolled_back_to = path
        if g.rollback_lr_factor != 1.0:
            scheduler = state.scheduler
            scheduler.base_lrs = [b * g.rollback_lr_factor for b in scheduler.base_lrs]
            for group in state.optimizer.param_groups:
                group["lr"] *= g.rollback_lr_factor
            scheduler._last_lr = [group["lr"] for group in state.optimizer.param_groups]
        event.update(
            restored_from=path.name,
            restored_step=state.step,
            skipped_ids=skipped,
            lr_factor=g.rollback_lr_factor,
        )
        return True

    def maybe_resume(self, state, model) -> dict | None:
        """Load checkpoint.resume ("auto": the newest valid one) into `state`; returns what the run
        record keeps of it, or None when the run starts fresh by configuration."""
        resume = self.cfg.checkpoint.resume
        if not resume:
            return None
        if resume == "auto":
            path, skipped = ckpt.latest_valid(self.root)
            for name, reason in skipped if self.env.is_main else []:
                print(f"trainplan train: skipped checkpoint {name}: {reason}", file=sys.stderr)
            info = {"skipped": [{"checkpoint": n, "reason": why} for n, why in skipped]}
            if path is None:
                return {**info, "from": None}
        else:
            refuse_unusable_resume(self.cfg)  # (run/setup.py asked first, before anything was built)
            path = Path(resume)
            info = {"skipped": []}
        saved = self._load(path, state)
        if state.step >= self.cfg.train.steps:
            raise ConfigError(
                "train.steps",
                f"{path.name} is at step {state.step}, at or past train.steps = {self.cfg.train.steps}: "
                "nothing is left to train",
                "raise train.steps to train on from it",
            )
        self.run_id = saved.get("run_id") or self.run_id  # continue that run's lineage
        info["loaded"] = state_hashes(model, state.optimizer, stages=(self.env, self.dims) if self.staged else None)
        for note in saved["notes"] if self.env.is_main else []:
            print(f"trainplan train: resume: {note}", file=sys.stderr)
        self.last, self.last_step, self.last_sampler = path, state.step, state.sampler.state_dict()
        return {**info, "notes": saved["notes"], "from": str(path), "step": saved["step"]}

    def _window(self, sampler, through_step: int) -> list[int]:
        """As PaLM did: the sample ids the batches from the last checkpoint through `through_step`
        were or would be drawn from, replayed from the checkpoint's data position with the ids
        skipped so far left out, so none of them is drawn or skipped twice. In the global order:
        every rank computes the same list."""
        probe = copy.deepcopy(sampler)
        probe.load_state_dict(self.last_sampler)
        draws = (through_step - self.last_step) * self.batch.grad_accum_steps  # one per micro-batch, as the loop
        return list(dict.fromkeys(i for _ in range(draws) for i in probe.take_global(self.batch.micro_batch_size)))
