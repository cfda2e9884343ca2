"""Pipeline parallelism (parallel.pp): the decoder layers split into pp stages by
ParallelDims.stage_layers (an even split, earlier stages take the remainder), the embedding on the
first stage, the final norm, the head and the loss on the last, run by torch.distributed.pipelining's
1F1B schedule with the accumulation window's micro-batches as its micro-batches.

The planner plans every layout with pp. `trainplan train` runs pp alone (every rank a stage) or with
each stage replicated by DDP (parallel.strategy = "ddp") or sharded by FSDP2 ("zero3", "fsdp-grad-op")
on the data axis, for full fine-tuning and
LoRA on Llama models with an untied head: the model is cut to the
rank's stage before its weights load (engine.py `apply`), the step, the held-out metric, the
checkpoint (DCP, each stage its own tensors) and the result (each stage writes its own file) go through the
stages (tests/run/test_pipeline_parallel.py). What it does not run beside pp is refused by name below."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.parallel import ParallelDims

# The architectures the stage forward (engine.py `Stage`) runs: LlamaModel's forward, one causal mask
# for every layer. Mistral's and Qwen2/3's sliding-window layers take a mask of their own kind.
MODEL_TYPES = ("llama",)
# The data-axis strategies FSDP2 runs inside a stage (engine.py Pipeline): each stage's layers and its
# own root sharded over the stage's replicas.
SHARDED = ("zero3", "fsdp-grad-op")


def on(cfg: RunConfig) -> bool:
    return cfg.parallel.pp > 1


def active(r: Resolved) -> bool:
    return r.dims.pp > 1


def refuse(r: Resolved) -> None:
    """ParallelDims refuses a pp that does not divide the world or exceeds the layers (spec/parallel.py)."""


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if dims.pp == 1:
        return
    from trainplan.features import activation_offload, optim8bit, optimizer_offload, qlora, step_in_backward
    from trainplan.spec.parallel import resolve_batch
    from trainplan.spec.precision import PRECISIONS

    if cfg.mode == "inference":
        raise NotRunnable(
            "parallel.pp",
            "the engine's pipeline runs training steps; inference (generation through the stages) is planned, not run",
            "set parallel.pp = 1 for inference",
            what="inference through pipeline stages",
        )
    if dims.dp > 1 and dims.strategy not in ("ddp", *SHARDED):
        raise NotRunnable(
            "parallel.pp",
            "the engine runs pipeline stages alone, replicated by DDP or sharded by FSDP2 on the data axis, and "
            f"this layout is {dims.describe()}",
            'set parallel.strategy = "ddp" or "zero3" beside parallel.pp',
            what="pipeline parallelism with ZeRO-1",
        )
    if dims.shards_params and dims.dp == 1:
        raise NotRunnable(
            "parallel.strategy",
            f"{dims.strategy} shards each stage over its replicas, and this layout has one ({dims.describe()})",
            'set parallel.strategy = "single" with parallel.pp alone, or give the stages replicas (a world of pp x dp)',
            what="FSDP2 over one replica of pipeline stages",
        )
    if cfg.mode != "full" and cfg.model.init == "random":
        raise NotRunnable(
            "model.init",
            "each stage draws its own random base, unlike one process; an adapter checkpoint holds no base, so "
            "resumed on another layout it would continue on another base",
            'give the run pretrained weights (model.source with weights), or use mode = "full" with parallel.pp',
            what="LoRA on a random base with pipeline parallelism",
        )
    off = "turn it off with parallel.pp, or set parallel.pp = 1"
    untried = [
        ("run.mode", "QLoRA's 4-bit base", qlora.on(cfg), 'use mode = "lora" with parallel.pp, or parallel.pp = 1'),
        ("optim.name", "8-bit AdamW", optim8bit.on(cfg), 'use optim.name = "adamw" with parallel.pp'),
        ("parallel.offload_optimizer", "optimizer offload", optimizer_offload.on(cfg), off),
        ("memory.offload_activations", "activation offload", activation_offload.on(cfg), off),
        ("train.step_in_backward", "the optimizer step in backward", step_in_backward.on(cfg), off),
        ("train.largest_batch_first", "the largest-batch probe", cfg.train.largest_batch_first, off),
        (
            "run.precision",
            "fp16 loss scaling",
            cfg.precision != "auto" and PRECISIONS[cfg.precision].loss_scaling,
            'use precision = "amp-bf16" (or "fp32") with parallel.pp',
        ),
    ]
    for field, what, on_, fix in untried:
        if on_:
            raise NotRunnable.beside(field, what, "pipeline parallelism", fix)
    accum = resolve_batch(cfg.batch, dims.dp).grad_accum_steps
    if accum < dims.pp:
        raise NotRunnable(
            "batch.grad_accum_steps",
            f"1F1B runs the accumulation window's micro-batches through the stages, and {accum} micro-batch(es) "
            f"cannot fill {dims.pp} stages (torch's Schedule1F1B needs at least one a stage)",
            f"set batch.grad_accum_steps >= {dims.pp}",
            what="a pipeline with fewer micro-batches than stages",
        )


def runnable_model(model_type: str, *, tied: bool) -> None:
    """What the stage split needs of the model, asked once it is known."""
    if model_type not in MODEL_TYPES:
        raise NotRunnable(
            "parallel.pp",
            f"the engine's pipeline stages run {', '.join(MODEL_TYPES)} models; this one is {model_type!r}",
            "set parallel.pp = 1",
            what=f"pipeline parallelism on {model_type}",
        )
    if tied:
        raise NotRunnable(
            "parallel.pp",
            "the model ties its head to its embedding, which sit on the first and the last stage; the engine "
            "does not sum the tied weight's gradient across the two",
            "set parallel.pp = 1 (or use a model with tie_word_embeddings = false)",
            what="pipeline parallelism with tied embeddings",
        )


def untraceable(r: Resolved) -> str | None:
    """The trace runs the first stage, its peers faked (plan/tracestep.py), alone or split by tp. Not
    replicated by DDP (its replicas are not derived from the stage's trace), nor sharded by FSDP2: that
    trace was 9.4 % under the first stage's measured 1F1B step on 4 gloo ranks (the plan is within 0.1 %
    there), a gap not yet found."""
    if r.dims.pp > 1 and r.dims.dp > 1:
        return (
            f"parallel.strategy: the trace runs a pipeline's first stage alone or split by tp, not {r.dims.strategy} "
            "over its replicas; use `trainplan plan` for this layout (its terms are measured per rank)"
        )
    return None
