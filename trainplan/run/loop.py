"""The one training loop: set up, evaluate, step, evaluate, check the contract.

`trainplan train CONFIG.toml` runs it in one process; `torchrun --nproc_per_node N -m trainplan
train CONFIG.toml` runs it on N ranks (gloo on CPU, NCCL on GPU). `run` returns the run record;
the caller writes and registers it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from pathlib import Path

import torch

from trainplan import config as C
from trainplan import features, startup
from trainplan.errors import TrainplanError
from trainplan.features.activation_offload import engine as offload
from trainplan.run import callbacks as cb
from trainplan.run import contract, dist, evaluate, measure, preflight, record, result, step, weights
from trainplan.run.checkpoint.manager import CheckpointManager
from trainplan.run.guard import StepGuard
from trainplan.run.progress import Progress
from trainplan.run.setup import Job, TrainState, prepare, train_state
from trainplan.run.trackers import Trackers, require


def run(
    cfg: C.RunConfig, *, quiet: bool = False, progress: Progress | None = None, bill: preflight.BillFn | None = None
) -> tuple[record.RunRecord, dist.DistEnv]:
    """Run the job described by cfg; returns the run record and the process group's environment.

    quiet: no progress at all. progress: the caller's reporter (accept's, for its runs); by
    default the run has its own, at train.log_every / log_every_s, on the main rank. bill: the
    plan's per-rank needs of a resolved config, checked by every rank's preflight (setup.prepare)."""
    dist.configure_cuda_allocator(cfg.memory.expandable_segments)  # before anything initializes CUDA
    env = dist.init(cfg.parallel.timeout_s, host_tensors=features.optimizer_offload.on(cfg))
    require(cfg.train.report_to)  # a logger whose package is missing is refused before anything is created
    own = progress is None or quiet or not env.is_main
    if own:
        progress = Progress.for_config(cfg.train, enabled=not quiet and env.is_main)
    t_start = time.perf_counter()
    job, trackers, status = None, Trackers(), "error"
    try:
        with Interrupts() as interrupts:
            job = prepare(cfg, env, progress, bill)
            startup.release()  # the model is built: collection resumes (held by a process's entry)
            progress.commit()  # past every refusal of the input: what was held back is shown
            trackers = Trackers.open(job.cfg, main=env.is_main)
            trainer = Trainer(job, progress=progress, trackers=trackers)
            trainer.record.eval_before = trainer.evaluate()
            if job.training:
                trainer.train(interrupts)
            else:
                trainer.infer()
        rec = _conclude(trainer, cfg, env, t_start)
        if rec.result and env.is_main:
            result.write_card(rec)
        status = "interrupted" if rec.interrupted else "ok"
        return rec, env
    except RuntimeError as e:
        failure = _peer_failure(e, env, cfg.parallel.timeout_s)
        if failure:
            raise failure from None
        raise
    finally:
        _close(trackers, status, progress if own else None, job)


def _close(trackers: Trackers, status: str, progress: Progress | None, job: Job | None) -> None:
    """On every path out of a run: event files flushed, the heartbeat stopped (`progress`: the run's own
    reporter), the locks released, a one-rank group left."""
    try:
        trackers.close(status)
        if progress is not None:
            progress.close(ok=status != "error")
    finally:
        for lock in job.locks if job else ():
            lock.release()
        dist.leave_alone()


def _peer_failure(e: RuntimeError, env: dist.DistEnv, timeout_s: float) -> TrainplanError | None:
    """A collective's error that means a peer rank died or stopped answering, as the user's error."""
    lost = dist.lost_peer(e, env)
    if lost:
        return TrainplanError(lost)
    if env.world > 1 and dist.is_peer_timeout(e):
        return TrainplanError(
            f"parallel.timeout_s: rank {env.rank} waited {timeout_s} s for a peer rank that did not answer "
            f"({str(e).splitlines()[0][:160]}); find the stuck or dead rank, or raise parallel.timeout_s"
        )
    return None


def _conclude(trainer: Trainer, cfg: C.RunConfig, env: dist.DistEnv, t_start: float) -> record.RunRecord:
    """After the loop: the measured final evaluation, the phase peaks and the mode contract."""
    rec = trainer.record
    rec.eval_after = trainer.evaluate(measured=trainer.job.training)
    trainer.trackers.evaluation(trainer.state.step if trainer.state else 0, rec.eval_after)
    if cfg.train.measure_memory:
        peaks = {"device": str(env.device), "load": trainer.job.load_peak_bytes, **trainer.phase_peaks}
        rec.phase_memory = {"per_rank": env.gather(peaks)}
    optimizer = trainer.state.optimizer if trainer.state else None
    updates = sum(not s.get("skipped") for s in rec.steps)
    held_out = rec.eval_after["loss"] if trainer.job.training else None
    check = contract.check(
        cfg.mode, trainer.model, trainer.before, optimizer=optimizer, updates=updates, held_out_loss=held_out
    )
    if trainer.stages is not None:
        check = contract.of_stages(env.gather(check), trainer.job.resolved.dims)
    rec.contract = check.to_json()
    rec.wall_seconds = time.perf_counter() - t_start
    return rec


class Trainer:
    """One run's parts, injected: the job, its model (wrapped for data parallelism), the training
    state, the checkpoint manager, the stability guard, the progress reporter and the metrics
    loggers; `train()` is the loop."""

    def __init__(self, job: Job, *, progress: Progress | None = None, trackers: Trackers | None = None) -> None:
        self.job, self.env = job, job.env
        self.progress = progress or Progress.off()
        self.trackers = trackers or Trackers()
        self.pipeline = None  # pipeline parallelism: this rank's stage and its 1F1B schedule (DDP inside)
        if features.pipeline_parallel.active(job.resolved):
            from trainplan.features.pipeline_parallel.engine import Pipeline

            r = job.resolved
            self.pipeline = Pipeline(
                job.model,
                r.dims,
                job.env.rank,
                r.batch.grad_accum_steps,
                job.env.device,
                mesh=job.mesh,
                prec=r.precision,
            )
        wrapped = job.training and self.pipeline is None
        self.model = dist.wrap(job.model, job.resolved.dims, job.env) if wrapped else job.model
        self.before = contract.snapshot(self.model)
        self.record = record.header(job)
        self.state: TrainState | None = None
        self.phase_peaks: dict[str, int] = {}  # evaluate, save: the device's measured peak in each
        self.replays: dict[int, int] = {}  # step -> how many of its runs a rollback undid
        self.inject: tuple[str, ...] = ()  # the faults a test injects into the next step (run/faults.py)
        self.settings = step.StepSettings(
            prec=job.resolved.precision,
            device_type=job.env.device.type,
            max_grad_norm=job.cfg.train.max_grad_norm,
            grad_scale=float(job.resolved.dims.dp),  # the ranks gradients are averaged over (cp's too)
        )
        self.record.hardware["ran"] = self._as_run(None)

    @property
    def stages(self) -> tuple[dist.DistEnv, object] | None:
        """(env, layout) of a pipeline's ranks (None: no pipeline): each stage's tensors are its own."""
        return (self.env, self.pipeline.dims) if self.pipeline is not None else None

    def _as_run(self, optimizer) -> dict:
        ran = record.as_run(self.model, optimizer, self.settings.prec.compute_dtype)
        if self.pipeline is not None:  # each stage's own decoder layers, read back from its model
            ran["pp"] = self.pipeline.dims.pp
            if self.pipeline.ddp is not None:  # DDP wraps the stage's forward module, not the model
                ran["strategy"] = "ddp"
            ran["stage_layers"] = self.env.gather(self.pipeline.layers())
        return ran

    def _meter(self, phase: str):
        """A PhaseMeter that records its peak under `phase` (no-op unless memory is measured)."""
        if not self.job.cfg.train.measure_memory:
            return contextlib.nullcontext()
        optimizer = self.state.optimizer if self.state else None
        comm = self.pipeline.receive_buffers() if self.pipeline else ()
        held = self.pipeline.ddp if self.pipeline and self.pipeline.ddp else self.model  # (DDP's buckets)
        meter = measure.PhaseMeter(self.env.device, held, optimizer, comm=comm)

        @contextlib.contextmanager
        def recording():
            with meter:
                yield
            self.phase_peaks[phase] = meter.peak_bytes

        return recording()

    def evaluate(self, *, measured: bool = False) -> dict:
        """The held-out metric; `measured`: the evaluate phase's peak is recorded (after training,
        when the optimizer state exists, as the plan's evaluate phase assumes)."""
        meter = self._meter("evaluate") if measured else contextlib.nullcontext()
        with self.progress.stage("evaluate") as stage, meter:
            metrics = self._evaluate()
            stage.result = f"held-out loss {metrics['loss']:.4f} over {metrics['tokens']:,} tokens"
            return metrics

    def _evaluate(self) -> dict:
        job = self.job
        return evaluate.evaluate(
            self.model,
            job.eval.ids,
            job.eval.labels,
            positions=job.eval.positions,
            lengths=job.eval.lengths,
            micro_batch=job.resolved.batch.micro_batch_size,
            max_batches=job.cfg.train.eval_batches,
            prec=job.resolved.precision,
            device=self.env.device,
            training_run=job.training,
            pipeline=self.pipeline,
        )

    def infer(self) -> None:
        """Inference: one measured forward (the plan's inference phase) and a greedy sample."""
        job, env, rec = self.job, self.env, self.record
        if job.cfg.train.measure_memory:
            n = job.resolved.batch.micro_batch_size
            mb = job.eval.batch(slice(0, n), env.device)
            meter = measure.step_meter(features.torch_compile.active(job.resolved))(
                self.model, None, list(mb.values()), env.device, lora=False
            )
            with meter:
                step.eval_forward(
                    self.model, mb, prec=self.settings.prec, device_type=env.device.type, on_phase=meter.on_phase
                )
            rec.memory = {"step": 0, "per_rank": env.gather(meter.result())}
        rec.generation = generate(self.model, job.tokenizer, env)
        self.trackers.evaluation(0, rec.eval_before)

    def train(self, interrupts: Interrupts | None = None) -> None:
        """The loop: a step, then what the callbacks (run/callbacks.py) do around it, until the last step."""
        cfg, rec = self.job.cfg, self.record
        state = self.state = train_state(self.job, self.model)
        rec.hardware["ran"] = self._as_run(state.optimizer)
        ckpt = CheckpointManager(self.job.resolved, self.env, self.model)
        rec.resume = ckpt.maybe_resume(state, self.model)
        fixed = [state.sampler.take(self.job.resolved.batch.micro_batch_size) for _ in range(cfg.train.overfit_batches)]
        start = state.step
        measure_at = (start + 1 if cfg.train.steps - start >= 2 else start) if cfg.train.measure_memory else -1
        if cfg.train.measure_memory and cfg.train.measure_step:  # that step (its index here is 0-based)
            measure_at = cfg.train.measure_step - 1
        guard = StepGuard(state.guard, self.env)
        rec.guard = {"events": state.guard.events, "settings": dataclasses.asdict(cfg.guard)}
        callbacks = self.callbacks(interrupts or Interrupts(), ckpt, guard, start, sampled=not fixed)
        if start == 0:  # a resumed run's eval_before was of the weights before its checkpoint loaded
            self.trackers.evaluation(0, rec.eval_before)
        with self.progress.training(cfg.train.steps, start) as stage:
            t_train = time.perf_counter()
            while state.step < cfg.train.steps:
                if cb.ask(callbacks, "before_step", self, state) == cb.STOP:
                    break
                kept = state.step == measure_at
                metered = kept or cfg.train.measure_every_step
                entry = self.step(state, guard, fixed, metered=metered, keep=kept, inject=self.inject)
                answer = cb.ask(callbacks, "after_step", self, state, entry)
                if answer == cb.STOP:
                    break
            rec.train_seconds = time.perf_counter() - t_train
            cb.ask(callbacks, "train_end", self, state)
            stage.result = f"at step {state.step}/{cfg.train.steps}, {state.tokens_seen:,} tokens seen"
        rec.sampler = state.sampler.state_dict()
        rec.skipped_samples = list(state.sampler.skipped)
        rec.final = record.fingerprints(self.model, state, self.job.resolved.batch, stages=self.stages)
        out = Path(cfg.train.output_dir)
        with self.progress.stage("save", f"the {cfg.mode} result to {out / result.DIRNAME}"), self._meter("save"):
            base = weights.base_reference(cfg)
            stage = (self.pipeline.index, self.pipeline.dims.pp, self.pipeline.within) if self.pipeline else None
            rec.result = result.save(
                self.model, self.job.tokenizer, cfg.mode, out, self.env, base_model=base, stage=stage
            )

    def callbacks(
        self, interrupts: Interrupts, ckpt: CheckpointManager, guard: StepGuard, start: int, *, sampled: bool
    ) -> list:
        """The loop's callbacks, in the order they are asked: signals, (fault injection, tests only), the
        guard's verdict, evaluation, checkpoints, reporting, the early stop; the compile time at the end."""
        cfg = self.job.cfg
        out: list = [cb.Interruption(interrupts, ckpt, start)]
        if cfg.guard.inject:  # tests only: the product never imports fault injection
            from trainplan.run import faults

            out.append(faults.FaultInjection(cfg.guard))
        out += [
            cb.GuardVerdicts(guard, ckpt, sampled=sampled),
            cb.Evaluation(cfg.train.eval_every, cfg.train.steps),
            cb.Checkpoints(ckpt),
            cb.Reporting(),
        ]
        if cfg.train.largest_batch_first and start == 0:
            out.append(cb.LargestBatchProbe(start))
        if cfg.train.stop_after:
            out.append(cb.StopAfter(cfg.train.stop_after))
        if features.torch_compile.active(self.job.resolved):
            out.append(cb.CompileTime(self.job.resolved.spec.num_layers))
        return out

    def probe_largest_batch(self, state: TrainState) -> None:
        """The widest micro-batch the data can give (one document a row: the longest rows, spread over the
        ranks as the sampler would), forward and backward under the memory meter; nothing is updated, its
        gradients are dropped and the RNG is restored, so the run goes on as it would have."""
        job, env = self.job, self.env
        n, b = job.train.ids.shape[0], job.resolved.batch.micro_batch_size
        lengths = job.train.lengths
        order = sorted(range(n), key=lambda i: -int(lengths[i])) if lengths is not None else list(range(n))
        rows = order[: b * env.dp][env.dp_rank :: env.dp]
        mb = job.train.batch(rows, env.device)
        meter = measure.step_meter(features.torch_compile.active(job.resolved))(
            self.model, state.optimizer, list(mb.values()), env.device, lora=features.lora.on(job.cfg)
        )
        hooks = step.StepHooks(on_phase=meter.on_phase, decide=lambda *_: False)  # never applied
        devices = [env.device] if env.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), meter:
            step.train_step(self.model, step.Update(state.optimizer), [mb], self.settings, hooks=hooks)
        self.record.largest_batch_probe = {
            "after_step": state.step,
            "shape": list(mb["input_ids"].shape),
            "per_rank": env.gather(meter.result()["peak_bytes"]),
        }

    def step(self, state: TrainState, guard: StepGuard, fixed: list, *, metered: bool, keep: bool, inject) -> dict:
        """One optimizer step over the accumulation window; appends and returns its record entry."""
        env, job = self.env, self.job
        t0 = time.perf_counter()
        micro, ids = [], []
        for j in range(job.resolved.batch.grad_accum_steps):
            idx = fixed[j % len(fixed)] if fixed else state.sampler.take(job.resolved.batch.micro_batch_size)
            ids += idx
            micro.append(job.train.batch(idx, env.device))
        local_tokens = sum(step.target_tokens(mb) for mb in micro)
        tokens = int(env.data_sum(torch.tensor(float(local_tokens)))) if env.world > 1 else local_tokens
        lr = state.scheduler.get_last_lr()[0]
        meter = None
        if metered:
            inputs = [t for mb in micro for t in mb.values()]
            meter = measure.step_meter(features.torch_compile.active(job.resolved))(
                self.model,
                state.optimizer,
                inputs,
                env.device,
                lora=features.lora.on(job.cfg),
                comm=self.pipeline.receive_buffers() if self.pipeline else (),
            )
        guard.begin(state.step + 1, ids)
        hooks = step.StepHooks(on_phase=meter.on_phase if meter else lambda phase: None, decide=guard, inject=inject)
        moved = offload.of(self.model)  # memory.offload_activations: what its hooks pass to the host
        if moved is not None:
            moved.reset_peak()
        with meter or contextlib.nullcontext():
            if self.pipeline is not None:  # 1F1B through the stages: a replica's stages take the same micro-batches
                res = self.pipeline.step(state, micro, self.settings, token_count=tokens, hooks=hooks)
            else:
                res = step.train_step(self.model, state, micro, self.settings, token_count=tokens, hooks=hooks)
        measured_peaks = None
        if meter is not None:
            measured = meter.result()
            if moved is not None:
                measured["offloaded_activation_bytes"] = moved.peak_bytes
            if keep:  # the run's measured step: its whole breakdown
                self.record.memory = {"step": state.step + 1, "per_rank": env.gather(measured)}
            if job.cfg.train.measure_every_step:
                measured_peaks = env.gather(measured["peak_bytes"])
        dt = time.perf_counter() - t0
        entry = {
            "step": state.step + 1,
            "loss": guard.loss,
            "grad_norm": float(dist.full_tensor(res.grad_norm)),
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "seconds": dt,
            "memory": record.peak_memory(env),
        }
        if measured_peaks is not None:
            entry["measured_peak_bytes"] = measured_peaks
        if job.train.lengths is not None:  # one document a row: each micro-batch's (rows, tokens) on this rank
            entry["shapes"] = [list(mb["input_ids"].shape) for mb in micro]
        if not res.applied:
            entry["skipped"] = True
        if self.replays.get(entry["step"]):
            entry["replayed"] = self.replays[entry["step"]]  # times its earlier runs were rolled back
        self.record.steps.append(entry)
        state.step += 1
        state.tokens_seen += tokens
        return entry

    def replay_from(self, step: int) -> list[dict]:
        """After a rollback to `step`: the entries of the later steps leave the history, so a step
        counts once, by its last run; returns them for the rollback event that replaced them."""
        steps = self.record.steps
        kept = [s for s in steps if s["step"] <= step]
        replaced = steps[len(kept) :]
        steps[:] = kept
        for s in replaced:
            self.replays[s["step"]] = self.replays.get(s["step"], 0) + 1
        return replaced

    def report(self, event: dict) -> None:
        self.state.guard.events.append(event)
        if self.env.is_main:  # a warning: shown under --quiet too
            note = f": {event['note']}" if "note" in event else ""
            self.progress.line(
                f"trainplan train: guard: step {event['step']} {event['key']} {event['kind']} "
                f"({event['value']:.4g}) -> {event['action']}{note}",
                logging.WARNING,
            )


def generate(model, tokenizer, env: dist.DistEnv, prompt: str = "def fibonacci(n):", tokens: int = 16) -> dict:
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(env.device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return {"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)}


class Interrupts:
    """SIGINT and SIGTERM stop the run at the next step boundary instead of mid-step: the handler
    only records the signal (a second one interrupts at once). Every rank agrees on it before
    acting, so all of them write the same checkpoint. Installed in the main thread only."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.received = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second signal acts at once

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, env: dist.DistEnv) -> int:
        """The signal any rank received (the same on every rank), or 0."""
        if env.world == 1:
            return self.received
        return int(env.all_reduce_max(torch.tensor(float(self.received))))
