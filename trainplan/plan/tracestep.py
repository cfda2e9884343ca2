"""One engine step on fake tensors, its peak memory recorded phase by phase: what `trainplan trace`
(plan/traced.py) and the derived terms (plan/derived.py) both measure. The model comes from
run/build.py and the step from run/step.py, the code `train` runs."""

from __future__ import annotations

import contextlib

from trainplan import resolve


class PhasePeaks:
    """The tracker's categories at each phase's peak, recorded on the measured (second) step."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.phases: dict[str, dict[str, int]] = {}
        self.current: str | None = None
        self.measuring = False
        self.entering: dict[str, dict[str, int]] = {}  # what is live as each phase of the measured step begins

    def on_phase(self, name: str) -> None:
        if self.tracker.events is not None:  # the allocator replay's phase marks; the warm-up step's apart
            self.tracker.events.append(("phase", name if self.measuring else f"warm-up {name}"))
        if self.current is not None and self.measuring:
            snap = self.tracker.peak_by_category()
            old = self.phases.get(self.current)
            if old is None or sum(snap.values()) > sum(old.values()):
                self.phases[self.current] = snap
        if self.measuring:
            self.entering[name] = dict(self.tracker.totals)
        self.tracker.reset_peak()
        self.current = None if name == "end" else name


TRACED_DOCUMENT = 4096  # tokens: the longest document of a traced row of packed documents


def row_documents(seq_len: int) -> tuple[int, ...]:
    """The documents of each row of a traced step on packed documents: two halves of the row, or documents of
    TRACED_DOCUMENT tokens in a longer one (the plan does not depend on their lengths; the trace's time does)."""
    if seq_len <= 2 * TRACED_DOCUMENT:
        return seq_len // 2, seq_len - seq_len // 2
    whole, rest = divmod(seq_len, TRACED_DOCUMENT)
    return (TRACED_DOCUMENT,) * whole + ((rest,) if rest else ())


def two_steps(
    r: resolve.Resolved, model, optimizer, micro_batches, tokens: int, peaks: PhasePeaks, kernels, pipeline=None
):
    """A warm-up step (it creates the optimizer state; activation checkpointing's first peak is
    spurious), then the measured one, through the engine's own step (a pipeline's first stage: its 1F1B
    step over the window's micro-batches)."""
    from trainplan import _torch_private as P
    from trainplan.run import step

    settings = step.StepSettings(prec=r.precision, device_type="cpu")
    hooks = step.StepHooks(on_phase=peaks.on_phase)
    from trainplan.run import attention

    packed = "position_ids" in micro_batches[0]
    # packed documents: transformers' mask code told they are (eager attention), and trainplan's attention
    # told where (fake position ids hold no values)
    b, s = micro_batches[0]["input_ids"].shape
    documents = attention.documents([row_documents(s)] * b) if packed else contextlib.nullcontext()
    with peaks.tracker, P.packed_sequences() if packed else P.unpacked_sequences(), documents, kernels:
        for iteration in range(2):
            peaks.measuring = iteration == 1
            if pipeline is not None:
                pipeline.step(step.Update(optimizer), micro_batches, settings, token_count=tokens, hooks=hooks)
            elif r.cfg.mode == "inference":
                step.eval_forward(model, micro_batches[0], prec=r.precision, device_type="cpu", on_phase=peaks.on_phase)
            else:
                step.train_step(model, step.Update(optimizer), micro_batches, settings, token_count=tokens, hooks=hooks)


@contextlib.contextmanager
def rank_zero(dims, ranks: int):
    """The engine's mesh for rank 0 of `ranks`, its peers faked (torch's fake process group: a collective
    allocates what a real one does and sends nothing); None for one rank. plan/traced.py and
    plan/derived.py trace under it."""
    if ranks == 1:
        yield None
        return
    import torch

    from trainplan import _torch_private as P
    from trainplan.run import dist

    with P.fake_process_group(ranks):
        yield dist.mesh(dist.DistEnv(rank=0, local_rank=0, world=ranks, device=torch.device("cpu")), dims)


def traced_step(
    r: resolve.Resolved,
    *,
    real: bool,
    target: str,
    world: int,
    mesh=None,
    events: list | None = None,
    entering: dict | None = None,
    input_grads: bool = False,
):
    """Build the model as the engine does, then trace two steps: (phase peaks, adapter bytes,
    optimizer state bytes, trainable shapes). events: a list to fill with the allocation stream (the
    model, batch and optimizer state first, then both steps), for plan/allocator.py to replay.
    entering: a dict to fill with what is live, by category, as each phase of the measured step
    begins (at "backward": what the forward saved, and the loss). input_grads: the embedding's output
    requires a gradient, so that under LoRA the first layer saves what the others do (plan/derived.py
    measures the difference)."""
    import torch

    from trainplan import _torch_private as P
    from trainplan.run import build, measure, sources, step

    cfg, dims, prec, batch = r.cfg, r.dims, r.precision, r.batch
    staged = dims.pp > 1  # the first stage, its peers faked: 1F1B over the whole window
    # (one process: the second micro-batch sees accumulated grads)
    micro_steps = batch.grad_accum_steps if staged else min(batch.grad_accum_steps, 2)
    on_mesh = mesh is not None or staged
    model = build.build_model(r.spec, cfg, prec, dims=dims if on_mesh else None, mesh=mesh, stage=0)
    if input_grads:
        # the embedding's output made to require a gradient as a layer's output does: through an op
        # that keeps nothing (transformers' enable_input_require_grads makes it a leaf instead, which
        # autograd's graph holds to the end of backward: a tokens x hidden tensor no layer saves, in
        # architectures whose first layer does not save its input, OLMo-2's, Granite's, Cohere's)
        def through_an_op(module, args, output):
            return output + torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)

        model.get_input_embeddings().register_forward_hook(through_an_op)
    with contextlib.nullcontext() if real else P.fake_mode() as fake, P.grouped_mm_any_dtype():
        if real:
            torch.manual_seed(0)
            build.materialize(model, "cpu")
        else:
            build.allocate(model, "cpu")
        ids = torch.randint(0, r.spec.vocab_size, (batch.micro_batch_size, batch.seq_len))
        # labels are their own tensor, as in training (prompt tokens masked with -100)
        micro_batches = [{"input_ids": ids, "labels": ids.clone()} for _ in range(micro_steps)]
        if sources.packing(r.cfg.data)[0] == "document":  # positions restarting per document
            positions = torch.cat([torch.arange(n) for n in row_documents(batch.seq_len)])
            for mb in micro_batches:
                mb["position_ids"] = positions.expand(batch.micro_batch_size, -1).clone()
        pipeline = None
        if staged:  # before the optimizer: it shards the stage's root under FSDP2
            from trainplan.features.pipeline_parallel.engine import Pipeline

            pipeline = Pipeline(model, dims, 0, micro_steps, "cpu", mesh=mesh, prec=prec, example=micro_batches[0])
        optimizer = None
        if cfg.mode != "inference":
            o = cfg.optim
            optimizer = step.build_optimizer(model, o.name, o.implementation, o.lr, o.weight_decay, target)
        tracker = P.StorageTracker(fake)
        tracker.events = events
        tracker.track(model, optimizer, [t for mb in micro_batches for t in mb.values()])
        tokens = micro_steps * batch.micro_batch_size * (batch.seq_len - 1) * world
        peaks = PhasePeaks(tracker)
        kernels = P.cuda_kernels() if target == "cuda" and not real else contextlib.nullcontext()
        two_steps(r, model, optimizer, micro_batches, tokens, peaks, kernels, pipeline)
        if entering is not None:
            entering.update(peaks.entering)
        trainable = [p for p in model.parameters() if p.requires_grad]
        adapter_params = sum(measure.local_nbytes(p) for p in trainable) if cfg.mode == "lora" else 0
        opt_state = [t for s in optimizer.state.values() for t in s.values()] if optimizer is not None else []
        states = sum(measure.local_nbytes(t) for t in opt_state if isinstance(t, torch.Tensor))
    return peaks.phases, adapter_params, states, [tuple(p.shape) for p in trainable], micro_steps
