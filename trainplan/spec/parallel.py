"""Parallel degrees and batch arithmetic, validated once and shared by plan and run.

Mesh order is (pp, dp, tp), tp innermost as in torchtitan: rank = (pp_i * dp + dp_i) * tp + tp_i.
Context parallelism (cp) splits each data-parallel replica's sequences over cp ranks, which replicate or
shard the weights like data-parallel ranks: `dp` counts the weights' replicas (data x cp, torchtitan's
dp_shard_cp), `data_dp` the replicas that read their own batches; cp is innermost within dp.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainplan.config import BatchConfig, ParallelConfig
from trainplan.errors import ConfigError
from trainplan.spec.model import ModelSpec

# The strategies FSDP2 runs: parameters sharded (dim 0), gathered per unit.
PARAM_SHARDING_STRATEGIES = ("zero3", "fsdp-grad-op")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    world_size: int
    dp: int
    tp: int
    pp: int
    strategy: str  # ddp | zero1 | zero2 | zero3 | fsdp-grad-op (dp > 1), "single" otherwise
    offload_optimizer: bool = False
    cp: int = 1  # context parallelism: the ranks of dp that share one replica's sequences

    @property
    def data_dp(self) -> int:
        """The replicas that read batches of their own: dp over the cp ranks that share each one's."""
        return self.dp // self.cp

    def cp_index(self, rank: int) -> int:
        """A rank's share of its replica's sequences (0 .. cp - 1)."""
        return self.coords(rank)[1] % self.cp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_stage, dp_index, tp_index) of a global rank."""
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        return rank // (self.tp * self.dp), dp_i, tp_i

    def stage_layers(self, stage: int, num_layers: int) -> range:
        """Decoder layers held by a pipeline stage: an even split, earlier stages get the remainder."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    # What each strategy does, by name. "single" (dp = 1) does none of it.

    @property
    def shards_params(self) -> bool:
        """zero3 and fsdp-grad-op: FSDP2 (fully_shard) keeps a dim-0 shard of every parameter per rank
        and all-gathers a unit, in the compute dtype, to use it. ddp, zero1 and zero2 replicate them."""
        return self.strategy in PARAM_SHARDING_STRATEGIES

    @property
    def shards_stages(self) -> bool:
        """FSDP2 inside pipeline stages: each stage's parameters sharded over its replicas (more than one)."""
        return self.pp > 1 and self.shards_params and self.dp > 1

    @property
    def reshard_after_forward(self) -> bool:
        """zero3 only: FSDP2's reshard_after_forward=True frees a unit's gathered parameters after its
        forward and gathers them again for backward. fsdp-grad-op (ZeRO-2-like SHARD_GRAD_OP) keeps
        every unit gathered from forward through backward; the replicating strategies never gather."""
        return self.strategy == "zero3"

    @property
    def shards_grads(self) -> bool:
        """zero2, zero3 and fsdp-grad-op: gradients are reduce-scattered and each rank keeps 1/dp of
        them. ddp and zero1 all-reduce (DDP), so every rank holds the whole gradient."""
        return self.strategy in ("zero2", "zero3", "fsdp-grad-op")

    @property
    def shards_optimizer(self) -> bool:
        """Every ZeRO stage (zero1, zero2, zero3, fsdp-grad-op): a rank keeps the optimizer states of
        its own part of the parameters only. zero1 splits by whole tensors (see
        partitions_optimizer_by_tensor), the others 1/dp of every tensor. ddp keeps all of them."""
        return self.strategy in ("zero1", "zero2", "zero3", "fsdp-grad-op")

    @property
    def partitions_optimizer_by_tensor(self) -> bool:
        """zero1 only: torch's ZeroRedundancyOptimizer (the engine's ZeRO-1) gives each rank whole
        tensors, largest first to the least-loaded rank, so the shares are uneven and each
        data-parallel rank has its own bill. zero2, zero3 and fsdp-grad-op split every tensor evenly."""
        return self.strategy == "zero1"

    @property
    def keeps_grad_buckets(self) -> bool:
        """ddp and zero1 (ZeroRedundancyOptimizer over a DDP-wrapped model): DDP's gradient buckets
        (gradient_as_bucket_view) are allocated once and hold the whole gradient between steps."""
        return self.strategy in ("ddp", "zero1")

    @property
    def keeps_grad_partition(self) -> bool:
        """zero2 only: DeepSpeed's ZeRO-2 (replicated parameters) reduces the gradients, a bucket at
        a time, into this rank's 1/dp partition, which it keeps between steps. FSDP2 (zero3,
        fsdp-grad-op) keeps its sharded gradients on the parameters, freed by zero_grad."""
        return self.strategy == "zero2"

    @property
    def keeps_grads_between_steps(self) -> bool:
        """ddp, zero1 (DDP buckets) and zero2 (its partition): gradients stay allocated from one step
        into the next forward. single, zero3 and fsdp-grad-op free them at zero_grad(set_to_none)."""
        return self.keeps_grad_buckets or self.keeps_grad_partition

    def describe(self) -> str:
        parts = [f"world {self.world_size}", f"dp {self.dp} ({self.strategy})"]
        if self.cp > 1:
            parts[1] = f"dp {self.data_dp} x cp {self.cp} ({self.strategy} over the {self.dp} ranks)"
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.pp > 1:
            parts.append(f"pp {self.pp} (1F1B)")
        if self.offload_optimizer:
            parts.append("optimizer offloaded to host")
        return ", ".join(parts)


def build_parallel_dims(cfg: ParallelConfig, world_size: int, model: ModelSpec) -> ParallelDims:
    """Check dp x tp x pp = world size and that tp/pp fit the model; say exactly what is wrong."""
    tp, pp = cfg.tp, cfg.pp
    if world_size % (tp * pp):
        raise ConfigError(
            "parallel.tp",
            f"tp {tp} x pp {pp} = {tp * pp} does not divide the world size {world_size} (number of devices)",
            f"use devices in a multiple of {tp * pp} or change parallel.tp / parallel.pp",
        )
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise ConfigError(
            "parallel.tp",
            f"tp {tp} does not divide the {model.num_heads} attention heads and "
            f"{model.num_kv_heads} KV heads of {model.name}",
            "choose a tp that divides both head counts",
        )
    if pp > model.num_layers:
        raise ConfigError(
            "parallel.pp",
            f"{pp} pipeline stages exceed the {model.num_layers} layers of {model.name}",
            f"use parallel.pp <= {model.num_layers}",
        )
    cp = _context_parallel(cfg.cp, world_size, model, tp=tp, pp=pp)
    dp = world_size // (tp * pp)
    strategy = cfg.strategy if dp > 1 else "single"
    if dp == 1 and cfg.strategy in PARAM_SHARDING_STRATEGIES:
        # FSDP2 over a one-rank mesh, as it runs: what a zero3 config does on one process (a resume on
        # fewer ranks, accept's one-process checks, the CPU offload's policy), planned and recorded as such
        strategy = cfg.strategy
    elif dp == 1 and cfg.strategy in ("zero1", "zero2"):
        # ZeRO-1/2 partition over data-parallel ranks, and there is one: a setting that would do nothing
        # would be planned and recorded as if it had
        raise ConfigError(
            "parallel.strategy",
            f"{cfg.strategy} partitions over the data-parallel ranks, but this layout has one "
            f"(world {world_size}, tp {tp}, pp {pp}), so it would run as a single process",
            'drop the setting (or set "ddp"), or plan more devices (e.g. --gpus 2xH100-80GB)',
        )
    return ParallelDims(
        world_size=world_size, dp=dp, tp=tp, pp=pp, strategy=strategy, offload_optimizer=cfg.offload_optimizer, cp=cp
    )


def _context_parallel(cp: int, world_size: int, model: ModelSpec, *, tp: int, pp: int) -> int:
    """cp divides the world and the query heads; key/value heads divide by cp or divide it (then each is repeated
    to cp of them); alone on the model's axes (beside data parallelism) until it composes with tp and pp."""
    if cp == 1:
        return cp
    if tp > 1 or pp > 1:
        axis = "parallel.tp" if tp > 1 else "parallel.pp"
        raise ConfigError(
            "parallel.cp",
            f"context parallelism beside {axis} (a 3-D layout) is not built yet; cp composes with data parallelism",
            f"set {axis} = 1 with parallel.cp, or parallel.cp = 1",
        )
    if world_size % cp:
        raise ConfigError(
            "parallel.cp",
            f"cp {cp} does not divide the world size {world_size} (number of devices)",
            f"use devices in a multiple of {cp} or change parallel.cp",
        )
    heads, kv = model.num_heads, model.num_kv_heads
    if heads % cp or (kv % cp and cp % kv):
        raise ConfigError(
            "parallel.cp",
            f"cp {cp} does not share out the {heads} attention heads and {kv} KV heads of {model.name} "
            "(each rank takes heads/cp of them; KV heads must divide by cp or divide it)",
            "choose a cp that divides both, or the KV heads divide: "
            + ", ".join(str(c) for c in range(2, heads + 1) if not heads % c and (not kv % c or not c % kv))
            or "none does; set parallel.cp = 1",
        )
    return cp


@dataclass(frozen=True, kw_only=True)
class ResolvedBatch:
    micro_batch_size: int
    grad_accum_steps: int
    dp: int
    seq_len: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def resolve_batch(cfg: BatchConfig, dp: int) -> ResolvedBatch:
    """global = micro x accum x dp. Any two of (global, micro, accum) give the third."""
    g, m, a = cfg.global_batch_size, cfg.micro_batch_size, cfg.grad_accum_steps
    if g is None:
        m, a = m or 1, a or 1
    elif m is None and a is None:
        m = 1
    if g is not None and a is None:
        if g % (m * dp):
            raise ConfigError(
                "batch.global_batch_size",
                f"{g} is not divisible by micro_batch_size {m} x data-parallel degree {dp} = {m * dp}",
                f"set it to a multiple of {m * dp} or change batch.micro_batch_size",
            )
        a = g // (m * dp)
    elif g is not None and m is None:
        if g % (a * dp):
            raise ConfigError(
                "batch.global_batch_size",
                f"{g} is not divisible by grad_accum_steps {a} x data-parallel degree {dp} = {a * dp}",
                f"set it to a multiple of {a * dp} or change batch.grad_accum_steps",
            )
        m = g // (a * dp)
    elif g is not None and m * a * dp != g:
        raise ConfigError(
            "batch.global_batch_size",
            f"{g} != micro_batch_size {m} x grad_accum_steps {a} x data-parallel degree {dp} = {m * a * dp}",
            "give only two of the three, and the third is derived",
        )
    return ResolvedBatch(micro_batch_size=m, grad_accum_steps=a, dp=dp, seq_len=cfg.seq_len)
