"""Pipeline parallelism in the engine: a causal LM cut to one stage in place, its stage forward, and the
optimizer step over torch.distributed.pipelining's 1F1B schedule.

The cut keeps the parameters' names: the stage's decoder layers stay under `model.layers.<i>` (a
ModuleDict keyed by their index in the whole model, torchtitan's layout), the embedding only on the
first stage, the final norm and the head only on the last; so a stage's state dict is its share of the
whole model's, key for key, and DCP can write and reshard it as it does FSDP's.

The step is `run/step.py train_step`'s, stage by stage: the accumulation window's micro-batches are the
schedule's micro-batches, each micro-batch's loss is its token-loss sum over the window's tokens (so the
gradients sum, scale_grads off, to the gradient of the window's mean, as one process accumulates them),
the gradient norm is taken over every stage's gradients (their squares summed across the pipeline) and
clips each stage's own, then each stage steps its own optimizer."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from trainplan.features import pipeline_parallel
from trainplan.run.converter import Build
from trainplan.run.dist import to_local
from trainplan.run.evaluate import logit_sums
from trainplan.run.loss import FusedLossHead, chunked_cross_entropy, chunked_eval_sums
from trainplan.run.step import NO_HOOKS, StepHooks, StepResult, StepSettings, apply_update, autocast, target_tokens
from trainplan.spec.parallel import ParallelDims


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a model (PEFT's LoRA wraps it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cut(model: nn.Module, dims: ParallelDims, stage: int) -> nn.Module:
    """Keep stage `stage`'s part of a causal LM (transformers' LlamaForCausalLM layout, under PEFT's
    LoRA too), in place; on the meta device before the weights load, so a rank allocates only its stage."""
    lm = causal_lm(model)
    config = lm.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    pipeline_parallel.runnable_model(config.model_type, tied=tied)
    base = lm.model
    layers = dims.stage_layers(stage, len(base.layers))
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
    if stage > 0:
        base.embed_tokens = None
    if stage < dims.pp - 1:
        base.norm = None
        lm.lm_head = None
    return model


def apply(model: nn.Module, b: Build) -> nn.Module:
    """The run's converter (run/build.py CONVERTERS): this rank's stage of a pipeline, cut from the
    meta model after the mode, the loss and checkpointing are applied to the whole model."""
    if b.dims is None or b.dims.pp == 1:
        return model
    return cut(model, b.dims, b.stage)


class Stage(nn.Module):
    """One stage's forward: LlamaModel.forward's body over the stage's layers. The first stage takes the
    ids, the others the previous stage's hidden states; every stage takes the micro-batch's position ids
    (each stage builds the same causal mask from them: block-causal over packed documents). The last
    stage returns the final norm's output, which the loss multiplies through the head."""

    def __init__(self, model: nn.Module, *, first: bool, last: bool) -> None:
        super().__init__()
        self.causal_lm = causal_lm(model)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        base = self.causal_lm.model
        hidden = base.embed_tokens(x) if self.first else x
        mask = create_causal_mask(
            config=base.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
        rotary = base.rotary_emb(hidden, position_ids=position_ids)
        for layer in base.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return base.norm(hidden) if self.last else hidden


class Pipeline:
    """This rank's stage of a pp-stage pipeline and its 1F1B schedule over `micro_batches` micro-batches a
    step. `model`: the stage, already cut (`cut`). With dp > 1 every stage is replicated over the data
    axis of `mesh`, the run's (pp, dp) mesh: the stages of one replica exchange activations in their "pp"
    group, and each stage's replicas reduce its gradients in their "dp" group, which torch's PipelineStage
    does at the window's last backward only: DDP around the stage (parallel.strategy "ddp"), or FSDP2
    ("zero3", "fsdp-grad-op"), whose decoder layers the builder sharded and whose stage module is sharded
    here as the root (`prec`: its mixed precision). Under tensor parallelism the mesh is (pp, dp, tp): the
    builder split the stage's layers, and its "pp" group joins the stages of one (dp, tp) place."""

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        rank: int,
        micro_batches: int,
        device,
        *,
        mesh=None,
        prec=None,
        example: dict | None = None,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if dims.world_size != dims.pp * dims.dp * dims.tp:  # internal: ParallelDims holds it
            raise AssertionError(f"the pipeline's ranks are its stages' replicas and tp ranks, got {dims.describe()}")
        self.dims, self.device = dims, torch.device(device)
        self.index = dims.coords(rank)[0]
        self.within = rank % (dims.dp * dims.tp)  # the rank's place among its stage's ranks (0 writes the stage)
        self.first, self.last = self.index == 0, self.index == dims.pp - 1
        self.model, self.lm = model, causal_lm(model)
        if isinstance(self.lm.model.layers, nn.ModuleList):  # internal: the stage is cut before its weights load
            raise AssertionError("the pipeline takes a model cut to its stage (engine.cut)")
        self.module = Stage(self.model, first=self.first, last=self.last)
        self.pp_group = self.dp_group = None  # None: the world (pipeline parallelism alone)
        self.ddp = None  # the stage's DDP wrapper (dp > 1): its gradient buckets persist between steps
        submod: nn.Module = self.module
        if dims.dp > 1 or dims.tp > 1:
            if mesh is None:  # internal: run/setup.py builds the (pp, dp[, tp]) mesh the stage was loaded on
                raise AssertionError("replicated or tp-split pipeline stages take the run's mesh")
            self.pp_group = mesh["pp"].get_group()
        if dims.dp > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.dp_group = mesh["dp"].get_group()
            if dims.shards_params:
                from trainplan.features.sharding.engine import shard_stage

                submod = shard_stage(self.module, dims, prec, mesh)
            else:
                ids = [self.device.index] if self.device.type == "cuda" else None
                submod = self.ddp = DistributedDataParallel(  # (the rotary buffers are every replica's)
                    self.module, ids, process_group=self.dp_group, gradient_as_bucket_view=True, broadcast_buffers=False
                )
        last = dims.pp - 1
        self.last_rank = dist.get_global_rank(self.pp_group, last) if self.pp_group is not None else last
        static = self._metadata(example, prec) if example is not None else {}  # (FSDP2's root exists by now)
        stage = PipelineStage(submod, self.index, dims.pp, self.device, group=self.pp_group, **static)
        self.schedule = Schedule1F1B(stage, micro_batches, loss_fn=self._loss, scale_grads=False)
        if example is not None:
            from trainplan import _torch_private as P

            P.static_pipeline(self.schedule)
        self._tokens = 1

    def _metadata(self, example: dict, prec) -> dict:
        """The first stage's metadata, given to torch's PipelineStage instead of exchanged with its peers
        (the trace fakes them: plan/tracestep.py): its input, the micro-batch's ids, and its output and
        the output's gradient, shaped as one no-grad forward of the stage on `example` makes them."""
        if not self.first:  # internal: the trace builds the first stage
            raise AssertionError("static pipeline metadata is the first stage's")
        ids = example["input_ids"]
        with torch.no_grad(), autocast(prec, self.device.type) if prec is not None else contextlib.nullcontext():
            out = self.module(ids, _positions(example))
        for module in self.module.modules():  # FSDP2's units left gathered (fsdp-grad-op's): sharded again
            if hasattr(module, "reshard"):
                module.reshard()
        meta = torch.empty_like(out, device="meta")
        return {
            "input_args": (torch.empty_like(ids, device="meta"),),
            "output_args": (meta,),
            "output_grads": (meta,),
        }

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's token-loss sum over the window's tokens (every replica's), through the head as
        one process computes it: the fused chunked loss where its head is installed, else transformers'
        loss; times dp, which DDP's average of the replicas' gradients divides back out."""
        head = self.lm.lm_head
        if isinstance(head, FusedLossHead):
            loss = chunked_cross_entropy(hidden, head.weight, labels, self._tokens, head.chunk_tokens)
        else:
            logits = head(hidden)
            loss = self.lm.loss_function(logits, labels, self.lm.config.vocab_size, num_items_in_batch=self._tokens)
        return loss * self.dims.dp if self.dims.dp > 1 else loss

    def step(
        self,
        update,
        micro_batches: list[dict],
        settings: StepSettings,
        *,
        token_count: int | None = None,
        hooks: StepHooks = NO_HOOKS,
    ) -> StepResult:
        """One optimizer step over the window, as run/step.py `train_step` takes it: every stage calls it
        with the same micro-batches (the first stage reads their ids, the last their labels, every stage
        their positions; each replica its own); `token_count`: the window's target tokens over every
        replica (the caller's sum). `update` holds the stage's optimizer and the scheduler, and
        `hooks.decide` (the guard) sees the window's loss and the pipeline's gradient norm on every rank,
        so all of them skip or apply the update together."""
        import torch.distributed as dist

        if update.scaler is not None:  # internal: resolve refuses fp16 loss scaling under pp
            raise AssertionError("the pipeline step takes no GradScaler")
        self._tokens = token_count if token_count is not None else sum(target_tokens(mb) for mb in micro_batches)
        ids = torch.cat([mb["input_ids"] for mb in micro_batches])
        labels = torch.cat([mb["labels"] for mb in micro_batches])
        positions = torch.cat([_positions(mb) for mb in micro_batches])
        losses: list[torch.Tensor] = []
        hooks.on_phase("1f1b")  # the micro-batches' forwards and backwards interleaved (verify/checks.py INTERLEAVED)
        with autocast(settings.prec, settings.device_type):
            if self.first:
                self.schedule.step(ids, position_ids=positions, target=labels, losses=losses, return_outputs=False)
            else:
                self.schedule.step(position_ids=positions, target=labels, losses=losses, return_outputs=False)
        loss = (
            torch.stack(losses).sum().detach().float() / self.dims.dp if self.last else self._zeros((), torch.float32)
        )
        # this replica's share of the window's mean on each of its stages (the guard sums the replicas')
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        hooks.on_phase("optimizer")
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [to_local(p.grad) for p in params]  # FSDP2's and tp's shards
        norm = self._norm(params, grads)
        if settings.max_grad_norm is not None and grads:  # torch's clip_grads_with_norm_, on the local shards
            with torch.no_grad():
                torch._foreach_mul_(grads, torch.clamp(settings.max_grad_norm / (norm + 1e-6), max=1.0))
        applied = apply_update(update, hooks.decide, loss, norm)
        update.optimizer.zero_grad(set_to_none=True)
        hooks.on_phase("end")
        return StepResult(loss=loss, grad_norm=norm, tokens=self._tokens, applied=applied)

    def _norm(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradient norm of the whole model: the squares of every rank's local gradients summed over
        the world, each divided by the ranks that hold the same values (a DTensor's Replicate axes: tp's
        norms, for one); DDP's replicas hold equal gradients after its average, so only the pipeline's
        stages are summed there."""
        import torch.distributed as dist

        squares = self._zeros((), torch.float64)
        for p, g in zip(params, grads, strict=True):  # each tensor's norm in its own dtype, as torch's clipping
            mesh, placements = getattr(p.grad, "device_mesh", None), getattr(p.grad, "placements", ())
            copies = (
                math.prod(n for n, at in zip(mesh.shape, placements, strict=True) if at.is_replicate()) if mesh else 1
            )
            squares += torch.linalg.vector_norm(g).double().square() / copies
        sharded = self.dims.shards_params or self.dims.tp > 1  # every gradient a DTensor
        dist.all_reduce(squares, group=None if sharded else self.pp_group)
        return squares.sqrt().float()

    def layers(self) -> list[int]:
        """The decoder layers this stage holds, by their index in the whole model."""
        return [int(i) for i in self.lm.model.layers]

    def receive_buffers(self) -> list[torch.Tensor]:
        """The receive buffers the stage allocated at its first step and keeps (one per micro-batch: the
        hidden states it receives, the output gradients it receives): the plan's comm_buffers, which the
        step meter is given, since they exist before the step it measures."""
        stage = self.schedule._stage
        infos = [*stage.args_recv_info.values(), *getattr(stage, "grad_recv_info", {}).values()]
        return [r.buffer for info in infos for r in info if getattr(r, "buffer", None) is not None]

    def eval_sums(self, batch: dict, labels: torch.Tensor, *, prec, device_type: str) -> torch.Tensor:
        """(loss sum, correct next-token predictions, target tokens) of one held-out batch, forward only
        through the stages (each sends its hidden states to the next, their dtype first), on every
        stage: run/evaluate.py's metric, computed on the last stage as one process computes it."""
        import torch.distributed as dist

        x, positions = batch["input_ids"], _positions(batch)
        with autocast(prec, device_type):
            if not self.first:
                code = self._zeros((), torch.int64)
                dist.recv(code, group=self.pp_group, group_src=self.index - 1)
                x = torch.empty((*x.shape, self.lm.config.hidden_size), dtype=_DTYPES[int(code)], device=self.device)
                dist.recv(x, group=self.pp_group, group_src=self.index - 1)
            hidden = self.module(x, positions)
            if not self.last:
                code = torch.tensor(_DTYPES.index(hidden.dtype), device=self.device)
                dist.send(code, group=self.pp_group, group_dst=self.index + 1)
                dist.send(hidden.contiguous(), group=self.pp_group, group_dst=self.index + 1)
                sums = self._zeros(3, torch.float64)
            else:
                sums = self._eval_sums(hidden, labels).to(self.device)
        dist.broadcast(sums, src=self.last_rank, group=self.pp_group)  # (NCCL's collectives take device tensors)
        return sums.cpu()

    def _zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _eval_sums(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = self.lm.lm_head
        if isinstance(head, FusedLossHead):
            return chunked_eval_sums(hidden, head.weight, labels, head.chunk_tokens).double().cpu()
        return logit_sums(head(hidden)[:, :-1].float(), labels)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _positions(batch: dict) -> torch.Tensor:
    """The micro-batch's position ids: its own where its rows pack documents, else 0..seq-1 on every row."""
    if "position_ids" in batch:
        return batch["position_ids"]
    rows, seq = batch["input_ids"].shape
    return torch.arange(seq, device=batch["input_ids"].device).expand(rows, seq).contiguous()
