"""memory.tiled_mlp: each decoder layer's MLP computed in tiles of the sequence under recompute, after ALST's
TiledMLP (Bekman et al. 2025, arXiv 2506.13996, section 3.2): forward runs the tiles without grad and keeps only
the MLP's input; backward recomputes one tile at a time and backpropagates it, so the (tokens x intermediate)
tensors exist for one tile, never whole. A layer's MLP saves its input in place of its intermediates, and the
step pays one more forward of the MLP. Tiles: ceil(tokens of a row / hidden size), as ALST shards it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainplan.errors import ConfigError, NotRunnable

if TYPE_CHECKING:
    from trainplan.config import RunConfig
    from trainplan.resolve import Resolved
    from trainplan.spec.model import ModelSpec
    from trainplan.spec.parallel import ParallelDims


def on(cfg: RunConfig) -> bool:
    return bool(cfg.memory.tiled_mlp)


def active(r: Resolved) -> bool:
    return on(r.cfg) and r.training


MAX_TILES = 256  # a small hidden size would cut a long row into thousands of tiles, each a round of kernel launches


def tiles(row_tokens: int, hidden_size: int) -> int:
    """How many tiles a row of `row_tokens` is cut into: ALST's ceil(seq / hidden), at least one, at most
    MAX_TILES (Llama-3.1-8B's hidden 4096 reaches it at 1M tokens a rank)."""
    return min(MAX_TILES, max(1, -(-row_tokens // hidden_size)))


def tileable(spec: ModelSpec) -> str | None:
    """Why this architecture's MLP cannot be tiled, or None: a dense MLP (gated or not) at `mlp`, computed
    token by token; a mixture of experts routes tokens across the sequence (its dispatch is not per tile)."""
    if spec.mlp.num_experts:
        return f"{spec.model_type}'s MLP is a mixture of {spec.mlp.num_experts} experts, whose routing is not per tile"
    if spec.layer_fit is not None:
        return f"{spec.model_type} is planned from a trace of its layers (derived terms), which has no MLP term to tile"
    return None


# The worst plan-vs-trace miss of a tiled plan, rounded up: tiny Llama, seq 1024, fp32, full and LoRA, with and
# without checkpointing (LoRA with checkpointing: the plan 6.4 % under in backward, whose recompute and tile
# moments are billed term by term only in part; full fine-tuning without it 3.6 % under)
BAND = 0.07


def band(r: Resolved, band: float, source: str) -> tuple[float, str]:
    """The accuracy band, widened where the tiled MLP's backward moments are in the bill."""
    if active(r):
        return band + BAND, f"{source}; + {BAND:.0%} for the tiled MLP's backward moments"
    return band, source


def refuse(r: Resolved) -> None:
    if not on(r.cfg):
        return
    if r.cfg.mode == "inference":
        raise ConfigError(
            "memory.tiled_mlp", "inference saves nothing for a backward to tile", "set memory.tiled_mlp = false"
        )
    why = tileable(r.spec)
    if why:
        raise ConfigError("memory.tiled_mlp", why, "set memory.tiled_mlp = false for this model")


def runnable(cfg: RunConfig, dims: ParallelDims, *, cuda: bool) -> None:
    if not on(cfg):
        return
    if dims.tp > 1 or dims.pp > 1:
        field = "parallel.tp" if dims.tp > 1 else "parallel.pp"
        raise NotRunnable.beside(
            "memory.tiled_mlp", "the tiled MLP", "tensor or pipeline parallelism", f"set {field} = 1"
        )


def untraceable(r: Resolved) -> str | None:
    return None
