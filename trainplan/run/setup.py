"""A run's set-up: the validated job (`prepare`) and its training state (`TrainState`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainplan import config as C
from trainplan import features
from trainplan.errors import ConfigError
from trainplan.features.torch_compile import engine as torch_compile
from trainplan.files import DirLock, require_writable
from trainplan.resolve import Resolved, model_facts, require_runnable, resolve
from trainplan.run import data, dist, guard, measure, preflight, step, weights
from trainplan.run.checkpoint.manager import (
    checkpoint_root,
    refuse_foreign,
    refuse_other_runs_checkpoint,
    refuse_unusable_resume,
)
from trainplan.run.progress import Progress
from trainplan.run.record import device_label
from trainplan.spec.devices import cpu_native_16bit, parse_devices


@dataclass(frozen=True)
class Split:
    """One side of the held-out split: its documents, packed into sequences and labels."""

    documents: list
    ids: torch.Tensor  # (sequences, seq_len)
    labels: torch.Tensor  # (sequences, seq_len)
    positions: torch.Tensor | None = None  # (sequences, seq_len) per document (data.packing "document")
    truncated: int = 0  # documents cut to seq_len
    filled: int = 0  # slots holding a document's token, not padding
    lengths: torch.Tensor | None = None  # (sequences,) real tokens a row (packing "none")

    @property
    def packing(self) -> str:
        return data.packing_name(self.positions, self.lengths)

    @property
    def efficiency(self) -> float:
        """Real tokens / slots: 1.0 under concat packing."""
        return self.filled / self.ids.numel()

    def batch(self, rows, device: torch.device) -> dict:
        """These rows as the model's inputs: ids and labels, and position ids where each document has its
        own; one document a row (packing "none"): cut to the longest of them, the rest is padding."""
        width = self.ids.shape[1] if self.lengths is None else int(self.lengths[rows].max())
        out = {"input_ids": self.ids[rows, :width].to(device), "labels": self.labels[rows, :width].to(device)}
        if self.positions is not None:
            out["position_ids"] = self.positions[rows].to(device)
        return out


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything a run needs before its first step, built by `prepare`."""

    cfg: C.RunConfig  # hardware.gpus is the devices actually present
    resolved: Resolved
    env: dist.DistEnv
    # the tokenizer, loaded when first asked for: a run whose packed splits were cached needs it only
    # after training (the sample generation, the result's files)
    load_tokenizer: Callable[[], object]
    train: Split
    eval: Split
    model: torch.nn.Module  # on its device, not yet wrapped for data parallelism
    load_peak_bytes: int | None = None  # the device's measured peak while the weights loaded
    mesh: object = None  # the DeviceMesh the model was sharded or split on (None: no FSDP2, tp or pp)
    locks: tuple = ()  # the main rank's DirLocks on the run's directories, released when the run ends

    @property
    def training(self) -> bool:
        return self.cfg.mode != "inference"

    @property
    def tokenizer(self):
        return self.load_tokenizer()


def prepare(
    cfg: C.RunConfig, env: dist.DistEnv, progress: Progress | None = None, bill: preflight.BillFn | None = None
) -> Job:
    """Resolve the config for the devices actually present, refuse what the engine cannot run,
    then build data and model (the stages load data, tokenize and load weights, reported to
    `progress`). bill: the plan's per-rank needs for the resolved config, which every rank's
    preflight checks before the model is built (run/preflight.py)."""
    progress = progress or Progress.off()
    if cfg.checkpoint.resume == "auto" and not (cfg.train.output_dir or cfg.checkpoint.dir):
        raise ConfigError(
            "checkpoint.resume",
            '"auto" looks in the run\'s own directory, and a run without train.output_dir gets a new, empty one',
            "give the --output-dir (or checkpoint.dir) of the run to continue",
        )
    if cfg.hardware.gpus not in ("auto", ""):  # train runs on the devices present; a typo is still refused
        asked = parse_devices(cfg.hardware.gpus, cfg.hardware.gpu_mem)
        if env.device.type == "cpu" and any(d.kind != "cpu" for d in asked):  # never a silent CPU run
            raise ConfigError(
                "hardware.gpus",
                f"{cfg.hardware.gpus!r} asks for GPUs, but this process sees none (torch.cuda.is_available() is False)",
                'run on a machine with them, or set hardware.gpus = "cpu" (or "auto") to train on the CPU',
            )
    cfg = dataclasses.replace(
        cfg,
        hardware=dataclasses.replace(cfg.hardware, gpus=device_label(env)),
        train=dataclasses.replace(cfg.train, output_dir=cfg.train.output_dir or default_output_dir(env)),
    )
    r = resolve(cfg)
    cfg = r.cfg  # as resolved: LoRA target sets expanded to this architecture's module names
    env = env.for_layout(r.dims)  # the tp ranks of a replica share its data
    require_runnable(cfg, r.dims, cuda=env.device.type == "cuda", **model_facts(r.spec))
    compute = r.precision.compute_dtype
    if env.device.type == "cpu" and compute != "fp32" and env.is_main and not cpu_native_16bit(compute):
        progress.line(
            f"warning: precision {cfg.precision}: this CPU has no {compute} instructions, so torch emulates its "
            f'{compute} matmuls (tens of times slower than fp32); precision = "fp32" (or "auto") is faster here',
            logging.WARNING,
        )
    # what can fail fast does, before any weights or tokenizer load: where the run writes, the data
    require_writable(cfg.train.output_dir, "train.output_dir")
    if cfg.checkpoint.dir:
        require_writable(cfg.checkpoint.dir, "checkpoint.dir")
    refuse_unusable_resume(cfg)
    # bad data fails before anything is created
    with progress.stage("load data", cfg.data.source) as stage:
        documents = data.load(cfg.data, cache=data.cache_dir(cfg.model.cache_dir))
        stage.result = "{:,} training and {:,} held-out documents".format(*map(len, documents))
    locks = _lock(cfg, env)
    try:
        refuse_foreign(cfg)
        weights.is_pretrained(cfg)  # an architecture without weights is the user's to fix before any resource check
        r = dataclasses.replace(r, spec=weights.as_built(cfg, r.spec))  # the spec the weights' config.json gives
        refuse_other_runs_checkpoint(r)
        with progress.stage("preflight") as stage:  # every rank, before any builds its model
            widest = _widest_possible(cfg, data.packing_of(documents[0], cfg.data.packing))
            stage.result = preflight.check(env, checkpoint_root(cfg) if r.training else None, bill and bill(widest))
        return _build(cfg, env, r, documents, locks, progress)
    except BaseException:
        for lock in locks:
            lock.release()
        raise


def _lock(cfg: C.RunConfig, env: dist.DistEnv) -> tuple[DirLock, ...]:
    """The main rank holds the output directory (and a separate checkpoint directory) for the
    run's lifetime: a second live run there is refused, naming the first."""
    if not env.is_main:
        return ()
    locks = [DirLock(cfg.train.output_dir, "train.output_dir").acquire()]
    root = checkpoint_root(cfg)
    if cfg.checkpoint.dir and root.resolve() != Path(cfg.train.output_dir).resolve():
        try:
            locks.append(DirLock(root, "checkpoint.dir").acquire())
        except BaseException:
            locks[0].release()
            raise
    return tuple(locks)


def _build(cfg: C.RunConfig, env: dist.DistEnv, r: Resolved, documents: tuple, locks: tuple, progress: Progress) -> Job:
    """r: as built (prepare gave it the weights' own config)."""
    if r.dims.shards_params and env.world == 1:  # zero3 on one process: FSDP2 over a one-rank mesh
        dist.join_alone(env, cfg.parallel.timeout_s)
    torch.manual_seed(cfg.train.seed)
    tokenizer = functools.cache(lambda: weights.load_tokenizer(cfg, r.spec))
    with progress.stage("tokenize") as stage:
        train, held_out, cached = _packed(cfg, r, documents, tokenizer)
        cut = train.truncated + held_out.truncated
        stage.result = (
            f"{train.ids.shape[0]:,} training and {held_out.ids.shape[0]:,} held-out sequences of "
            f"{'at most ' if train.lengths is not None else ''}{train.ids.shape[1]} tokens, {train.packing} packing "
            f"({train.efficiency:.0%} of the slots filled)"
            + (f", {cut:,} document(s) cut to {train.ids.shape[1]} tokens" if cut else "")
            + (" (packed by an earlier run: the same data and tokenizer)" if cached else "")
        )
    per_step = r.batch.micro_batch_size * env.dp
    ranks = "rank(s)" if env.dp == env.world else "replica(s)"  # tp ranks share a replica's batch
    if train.ids.shape[0] < per_step and not cfg.train.overfit_batches:
        raise ConfigError(
            "batch.micro_batch_size",
            f"{r.batch.micro_batch_size} per rank x {env.dp} {ranks} needs {per_step} sequences at once, but the "
            f"training split packs to {train.ids.shape[0]} of {r.batch.seq_len} tokens: samples would repeat "
            "within a batch",
            "lower batch.micro_batch_size or batch.seq_len, or add data",
        )
    if cfg.train.epochs:
        steps = data.steps_for_epochs(cfg.train.epochs, train.ids.shape[0], r.batch.global_batch_size)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    staged = features.pipeline_parallel.active(r)  # each rank builds and loads its own stage only
    sharded = r.dims.shards_params or features.tensor_parallel.active(r)
    mesh = dist.mesh(env, r.dims) if sharded or (staged and env.dp > 1) else None
    if staged and train.lengths is not None:
        raise ConfigError(
            "data.packing",
            "one document a row gives every micro-batch its own width, and a pipeline's stages exchange "
            "buffers of one fixed shape",
            'set data.packing = "document" (or "concat") with parallel.pp',
        )
    meter = measure.PhaseMeter(env.device) if cfg.train.measure_memory else None
    with progress.stage("load weights", cfg.model.source), meter or contextlib.nullcontext():
        model = weights.load_model(
            cfg,
            r.spec,
            r.precision,
            env.device,
            dims=r.dims if mesh or staged or features.context_parallel.active(r) else None,
            mesh=mesh,
            stage=r.dims.coords(env.rank)[0],
        )
    if features.torch_compile.active(r):  # compiled lazily, by the first step (the record's compile.seconds)
        torch_compile.compile_layers(model)
    return Job(
        cfg=cfg,
        resolved=r,
        env=env,
        load_tokenizer=tokenizer,
        train=train,
        eval=held_out,
        model=model,
        load_peak_bytes=meter.peak_bytes if meter else None,
        mesh=mesh,
        locks=locks,
    )


def _widest_possible(cfg: C.RunConfig, packing: str) -> C.RunConfig:
    """The config the preflight checks: one document a row (packing "none") may fill a micro-batch with
    rows of data.max_length, beyond batch.seq_len; `plan --data` finds the run's actual widest."""
    if packing != "none" or cfg.data.max_length <= cfg.batch.seq_len:
        return cfg
    return cfg.at_seq_len(cfg.data.max_length)


def _packed(cfg: C.RunConfig, r: Resolved, documents: tuple, tokenizer: Callable[[], object]) -> tuple:
    """(training Split, held-out Split, whether both came from the cache): each split packed by
    data.pack, or read back from the packed-split cache (data.cached_pack) that a run on the same
    documents, tokenizer files and sequence length left; only a miss loads the tokenizer."""
    seq, vocab, cache = r.batch.seq_len, r.spec.vocab_size, data.cache_dir(cfg.model.cache_dir)
    packing = data.packing_of(documents[0], cfg.data.packing)  # one packing for both splits
    if packing == "none" and cfg.data.max_length:
        seq = cfg.data.max_length
    held_out_from = (
        f"data.eval_source = {cfg.data.eval_source}"
        if cfg.data.eval_source
        else f"data.eval_fraction = {cfg.data.eval_fraction}"
    )
    source = weights.tokenizer_dir(cfg)
    splits, hits = [], 0
    for docs, name in zip(documents, ("training", "held-out"), strict=True):
        key = data.pack_key(docs, source, seq, packing)
        packed = data.cached_pack(cache, key, seq, vocab)
        if packed is None or packed.packing != packing:
            split = f"the {name} split ({held_out_from})"
            packed = data.pack(docs, tokenizer(), seq, vocab, packing=packing, split=split, cache=cache)
            with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run
                data.store_pack(cache, key, packed)
        else:
            hits += 1
        splits.append(Split(docs, *packed))
    if not bool((splits[0].labels[:, 1:] != data.IGNORE_INDEX).any()):
        raise ConfigError(
            "batch.seq_len",
            f"no token of the training split is learned at {seq} tokens a row ({packing} packing): every "
            "response falls outside its row",
            "raise batch.seq_len, or use shorter prompts",
        )
    return splits[0], splits[1], hits == 2


def default_output_dir(env: dist.DistEnv) -> str:
    """A directory of its own for a run that names none: runs/<date>-<time>-<6 hex>, chosen by
    rank 0 for every rank. (A shared default let one run prune, or resume from, another's
    checkpoints.)"""
    import secrets
    import time

    mine = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    return env.gather(mine)[0]


def lr_factor(cfg: C.TrainConfig):
    """The LR schedule as a factor of the base LR per step: linear warm-up, then constant or cosine."""

    def factor(i: int) -> float:
        if i < cfg.warmup_steps:
            return (i + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "cosine":
            progress = (i - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


@dataclass(kw_only=True)
class TrainState:
    """Training progress and every stateful part of the update, as torchtitan's Trainer holds it.

    `state_dict()` is the progress a checkpoint's state.json carries (step, tokens seen, data
    position, guard windows); the optimizer, scheduler and scaler go to their own checkpoint parts."""

    step: int = 0
    tokens_seen: int = 0
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    sampler: data.StatefulSampler
    guard: guard.Guard

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "sampler": self.sampler.state_dict(),
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Progress from a checkpoint's state.json (the torch parts are loaded by the checkpoint)."""
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.sampler.load_state_dict(state["sampler"])
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])


def train_state(job: Job, model: torch.nn.Module) -> TrainState:
    """A fresh state for `model` (wrapped for data parallelism): the optimizer the plan assumed."""
    cfg, env = job.cfg, job.env
    o = cfg.optim
    zero1 = job.resolved.dims.partitions_optimizer_by_tensor  # ZeroRedundancyOptimizer
    optimizer = step.build_optimizer(
        model,
        o.name,
        o.implementation,
        o.lr,
        o.weight_decay,
        # FSDP2's CPUOffloadPolicy: the parameters, so the step, are in host memory (the plan's host column)
        "cpu" if features.optimizer_offload.on_host(job.resolved.dims) else env.device.type,
        zero1=zero1,
        in_backward=features.step_in_backward.on(cfg),
    )
    scaler = torch.amp.GradScaler(env.device.type) if job.resolved.precision.loss_scaling else None
    return TrainState(
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg.train)),
        scaler=scaler,
        sampler=data.StatefulSampler(
            job.train.ids.shape[0],
            seed=cfg.train.seed,
            rank=env.dp_rank,
            world=env.dp,
            lengths=job.train.lengths if cfg.data.group_by_length else None,
            group=job.resolved.batch.micro_batch_size * env.dp * data.GROUP_MEGABATCH,
        ),
        guard=guard.Guard(cfg.guard, scaler=scaler is not None),
    )
