"""Pipeline parallelism (parallel.pp): the decoder layers split into pp stages by
ParallelDims.stage_layers (an even split, earlier stages take the remainder), the embedding on the
first stage, the final norm, the head and the loss on the last, run by torch.distributed.pipelining's
1F1B schedule with the accumulation window's micro-batches as its micro-batches.

The planner plans every layout with pp; the engine's stage split and schedule (engine.py) reproduce one
process's losses on gloo (tests/run/test_pipeline_parallel.py), and `trainplan train` does not run them
yet: what it lacks is the run around the step (held-out evaluation through the stages, the result saved
from every stage, the checkpoint and the memory meter per stage)."""

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


def on(cfg: RunConfig) -> bool:
    return cfg.parallel.pp > 1


def active(r: Resolved) -> bool:
    return r.dims.pp > 1


def refuse(r: Resolved) -> None:
    """ParallelDims refuses a pp that does not divide the world or exceeds the layers (spec/parallel.py)."""


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if dims.pp > 1:
        raise NotRunnable(
            "parallel.pp",
            "the training engine runs data and tensor parallelism (DDP, ZeRO-1, FSDP2, tp); pipeline stages "
            "are planned, not run",
            "set parallel.pp = 1 for `trainplan train`",
            what="pipeline parallelism",
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
    if r.dims.pp > 1:
        return (
            "parallel.pp: the trace covers data and tensor parallelism only; use `trainplan plan` for pipeline stages"
        )
    return None
