"""The sections of a RunConfig: nested keyword-only dataclasses, each validating itself in __post_init__
and naming the field (`batch.micro_batch_size`) and the fix; the comment on each field is its meaning
(`trainplan settings` reads them from this file).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from trainplan.errors import ConfigError, nearest

MODES = ("full", "lora", "qlora", "inference")
PRECISIONS = ("auto", "fp32", "amp-bf16", "amp-fp16", "bf16")
OPTIMIZERS = ("adamw", "adamw-8bit", "sgd", "sgd-momentum", "adafactor")
OPTIM_IMPLS = ("auto", "foreach", "fused", "for-loop")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op")
ATTENTIONS = ("auto", "sdpa", "eager")
MIN_LR = 1.1754943508222875e-38  # fp32's smallest normal number (torch.finfo(torch.float32).tiny)
MAX_RUNTIME_MIB = 2**20  # a CUDA context, a workspace, a Python runtime: 1 TiB is past any device
CONTROL_IN_PATH = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}", f"unknown value {value!r}", nearest(str(value), choices))


def _positive_int(
    section: str, name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, optional: bool = False
) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{section}.{name}",
            f"must be an integer >= {minimum} (got {value!r})",
            f"set {section}.{name} to an integer >= {minimum}",
        )
    if maximum is not None and value > maximum:
        raise ConfigError(
            f"{section}.{name}",
            f"{value:,} is past any real device (at most {maximum:,})",
            f"set {section}.{name} to what one process really holds",
        )


def _path(section: str, name: str, value: Any) -> None:
    """A directory trainplan writes: no control character (a newline in a name breaks every log line
    and launch file that shows it)."""
    if isinstance(value, str) and (m := CONTROL_IN_PATH.search(value)):
        raise ConfigError(
            f"{section}.{name}",
            f"holds a control character ({ascii(m.group())})",
            "give a path of printable characters",
        )


def _fraction(section: str, name: str, value: Any, *, top: float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < top:
        raise ConfigError(
            f"{section}.{name}",
            f"must be a number in [0, {top}) (got {value!r})",
            f"set {section}.{name} to a value in [0, {top})",
        )


_ALONE = [False]  # _section is checking one setting on its own: checks of settings together wait


def _together() -> bool:
    """Whether a check that reads two settings applies now: not while _section checks one setting
    beside the others' defaults (min_history against the default window, say), only once the
    whole section is built."""
    return not _ALONE[0]


INITS = ("auto", "pretrained", "random")
SCHEDULES = ("constant", "cosine")
DATA_FORMATS = ("auto", "text", "prompt-completion", "alpaca", "sharegpt", "messages")
DATA_PACKINGS = ("auto", "document", "concat", "none")
REPORTERS = ("tensorboard", "mlflow", "wandb", "none")  # train.report_to


@dataclass(kw_only=True)
class ModelConfig:
    # "default" (embedded SmolLM2-135M), a preset, an HF dir, a Hub id (local HF cache), config.json, .gguf
    source: str = "default"
    # auto / pretrained: load the source's weights (an HF dir, a .gguf, the default); a preset or a
    # config.json has none and is refused by train. random: train from scratch, asked for explicitly.
    init: str = "auto"
    cache_dir: str = "~/.cache/trainplan"  # GGUF files are converted once to safetensors here
    # a sequence beyond the model's max_position_embeddings is refused unless asked for (RoPE
    # scaling, or an experiment in extrapolation): quality beyond it is not assured
    extend_context: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError("model.source", "is empty", "name a preset, an HF directory, a config.json or a .gguf")
        _choice("model", "init", self.init, INITS)


@dataclass(kw_only=True)
class DataConfig:
    # default: the Python docs every CPython ships; a .txt, .jsonl, .json, .parquet or .csv file, a
    # directory of them, or "owner/name[:split]" already in the local Hugging Face cache (run/data.py)
    source: str = "default"
    format: str = "auto"  # auto (from the columns), text, prompt-completion, alpaca, sharegpt, messages
    eval_source: str = ""  # a separate held-out set, same kinds as source; "": hold out eval_fraction of source
    eval_fraction: float = 0.1  # share of source documents held out for evaluation; unused with eval_source
    # how documents fill the seq_len rows (run/data.py): "document" keeps each one to itself (block-causal
    # attention, positions restarting; a longer one is cut), "concat" packs them back to back, each seeing
    # those before it in its row; "none" puts one document a row, padded to the longest of its micro-batch;
    # "auto": document for prompt/completion, Alpaca and chat rows, concat for text
    packing: str = "auto"
    max_length: int = 0  # packing "none": a row's longest, longer documents cut (counted); 0: batch.seq_len
    group_by_length: bool = False  # packing "none": micro-batches of similar lengths (less padding)

    def __post_init__(self) -> None:
        for name in ("source", "eval_source"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"data.{name}",
                    f"must be a path or dataset id (got {getattr(self, name)!r})",
                    "write it as a string",
                )
        if not self.source.strip():
            raise ConfigError("data.source", "is empty", 'give a file, a directory, a cached dataset id, or "default"')
        _choice("data", "format", self.format, DATA_FORMATS)
        _choice("data", "packing", self.packing, DATA_PACKINGS)
        _positive_int("data", "max_length", self.max_length, minimum=0)
        if not isinstance(self.group_by_length, bool):
            raise ConfigError(
                "data.group_by_length", f"must be true or false (got {self.group_by_length!r})", "write true or false"
            )
        if _together() and (self.max_length or self.group_by_length) and self.packing != "none":
            name = "data.max_length" if self.max_length else "data.group_by_length"
            raise ConfigError(
                name, f'applies to data.packing = "none" (got {self.packing!r})', 'set data.packing = "none"'
            )
        _fraction("data", "eval_fraction", self.eval_fraction)
        if _together() and self.eval_fraction == 0 and not self.eval_source:
            raise ConfigError(
                "data.eval_fraction",
                "is 0: quality needs held-out data",
                "set it to e.g. 0.1, or give a separate evaluation set in data.eval_source",
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""  # default: <train.output_dir>/checkpoints
    every: int = 50  # optimizer steps between checkpoints; 0: none
    keep_last: int = 2  # this run's newest checkpoints kept; older ones are pruned
    resume: str = ""  # "auto": the newest valid checkpoint in dir; or a checkpoint path

    def __post_init__(self) -> None:
        _positive_int("checkpoint", "every", self.every, minimum=0)
        _positive_int("checkpoint", "keep_last", self.keep_last)
        _path("checkpoint", "dir", self.dir)


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 20  # optimizer steps
    # > 0: passes over the training split instead; sets train.steps once the data is packed
    # (ceil(epochs x training sequences / global batch))
    epochs: float = 0.0
    seed: int = 0  # model init, data order and dropout
    warmup_steps: int = 0  # linear warm-up from 0 to optim.lr
    schedule: str = "constant"  # constant | cosine (after warm-up)
    max_grad_norm: float = 1.0  # gradient clipping by global norm; 0: no clipping
    eval_every: int = 0  # 0: evaluate before and after only
    eval_batches: int = 8  # micro-batches of held-out data per evaluation; 0: the whole split
    output_dir: str = ""  # "": a directory of its own per run, runs/<date>-<time>-<id> (run/setup.py)
    stop_after: int = 0  # stop after this many steps without changing the schedule (an interruption)
    measure_memory: bool = True  # measure one real step per phase and device (the run's second step)
    measure_step: int = 0  # the step measured, 1-based (`plan --data` names the widest); 0: the run's second
    # every step's peak measured too (each step's entry: measured_peak_bytes per rank), as with unpacked
    # batches whose shape changes step by step; the storage tracker slows each step
    measure_every_step: bool = False
    # a memory probe: after step 1, one forward and backward of the widest micro-batch the data can give
    # (packing "none": its longest rows), its gradients dropped and nothing updated, so a run that cannot
    # hold it fails in its first minute, not hours in; the record says when it ran and what it measured
    largest_batch_first: bool = False
    overfit_batches: int = 0  # >0: every step reuses these first micro-batches (the overfit check)
    # The loss without the (tokens x vocab) logits: chunked fused linear cross-entropy (run/loss.py)
    fused_loss: bool = True
    loss_chunk_tokens: int = 128  # rows of logits formed at a time by the fused loss
    # torch.compile per decoder layer (regional compilation): false | true | "auto" (on for training on
    # GPUs; on the CPU compiling costs tens of seconds that a short run does not earn back)
    compile: bool | str = False
    # Progress where stderr is not a terminal (a batch job's log), run/progress.py; on a terminal
    # a progress bar shows every step.
    log_every: int = 10  # a timestamped progress line every this many steps
    log_every_s: float = 30.0  # and a line at least this often (seconds of work), however long a step takes
    # Metrics loggers, each writing under train.output_dir on the main rank: "tensorboard"
    # (tensorboard/), "mlflow" (a local file store, mlruns/), "wandb" (offline, wandb/), or "none".
    # One name may be given alone: report_to = "none" (or --set train.report_to=none).
    report_to: str | list[str] = field(default_factory=lambda: ["tensorboard"])

    def __post_init__(self) -> None:
        _positive_int("train", "steps", self.steps)
        _path("train", "output_dir", self.output_dir)
        _positive_int("train", "log_every", self.log_every)
        if isinstance(self.log_every_s, bool) or not isinstance(self.log_every_s, int | float) or self.log_every_s <= 0:
            raise ConfigError(
                "train.log_every_s", f"must be a positive number of seconds (got {self.log_every_s!r})", "e.g. 30"
            )
        if isinstance(self.report_to, str):  # report_to = "wandb", or --set train.report_to=none
            self.report_to = [self.report_to]
        for name in self.report_to:
            _choice("train", "report_to", name, REPORTERS)
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ConfigError("train.report_to", f'"none" with other loggers ({self.report_to})', 'give "none" alone')
        for name in ("seed", "warmup_steps", "eval_every", "eval_batches", "stop_after", "overfit_batches"):
            _positive_int("train", name, getattr(self, name), minimum=0)
        _positive_int("train", "loss_chunk_tokens", self.loss_chunk_tokens)
        _choice("train", "schedule", self.schedule, SCHEDULES)
        if (
            isinstance(self.epochs, bool)
            or not isinstance(self.epochs, int | float)
            or not math.isfinite(self.epochs)
            or self.epochs < 0
        ):
            raise ConfigError(
                "train.epochs", f"must be a number >= 0 (got {self.epochs!r})", "e.g. train.epochs = 3 (0: train.steps)"
            )
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ConfigError("train.compile", f"unknown value {self.compile!r}", 'use true, false or "auto"')
        _positive_int("train", "measure_step", self.measure_step, minimum=0)
        if _together() and not self.epochs and self.measure_step > self.steps:
            raise ConfigError(
                "train.measure_step",
                f"is step {self.measure_step}, past the run's {self.steps} steps: nothing would be measured",
                f"give a step from 1 to {self.steps}, or 0 for the second",
            )
        for name in ("measure_memory", "fused_loss", "measure_every_step", "largest_batch_first"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"train.{name}", f"must be true or false (got {getattr(self, name)!r})", "write true or false"
                )
        if (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, int | float)
            or self.max_grad_norm < 0
        ):
            raise ConfigError(
                "train.max_grad_norm",
                f"must be >= 0 (got {self.max_grad_norm!r})",
                "set train.max_grad_norm, e.g. 1.0 (0: no clipping)",
            )


GUARD_ACTIONS = ("skip", "rollback", "stop")
# sigint@N: this process gets SIGINT at step N; hang@N: the last rank stops itself (SIGSTOP) at step N;
# kill-writing@N, kill-publishing@N, kill-pruning@N: rank 0 SIGKILLs itself inside step N's checkpoint
# (parts half written; complete but not yet renamed; an old checkpoint half deleted)
KILL_KINDS = ("kill-writing", "kill-publishing", "kill-pruning")
INJECT_KINDS = ("nan-loss", "nan-grad", "spike", "sigint", "hang", *KILL_KINDS)


@dataclass(kw_only=True)
class GuardConfig:
    """The stability guard, checked at every optimizer step before the update is applied."""

    enabled: bool = True  # the stability guard (NaN/Inf, spikes, fp16 scale collapse)
    window: int = 128  # rolling window of recent losses and grad norms (OLMo-core: 128)
    threshold: float = 6.0  # z-score above the window's mean that counts as a spike
    min_history: int = 0  # values in the window before spikes are checked; 0: half the window
    on_nonfinite: str = "skip"  # a NaN/Inf loss or gradient on any rank
    on_spike: str = "skip"  # skip | rollback | stop
    on_scale_collapse: str = "stop"  # amp-fp16: the GradScaler's scale fell below min_loss_scale
    min_loss_scale: float = 1.0  # amp-fp16: the GradScaler scale below which on_scale_collapse acts
    rollback_skip: int = 0  # rollback skips the batches from the checkpoint through the bad step, and this many more
    rollback_lr_factor: float = 1.0  # multiply the learning rate after a rollback (e.g. 0.5)
    max_rollbacks: int = 3  # then stop
    # fault injection for tests: "nan-loss@5", "spike@9"; a KIND@STEP listed twice fires on the step's replay too
    inject: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("guard.enabled", f"must be true or false (got {self.enabled!r})", "write true or false")
        _positive_int("guard", "window", self.window, minimum=2)
        for name in ("min_history", "rollback_skip", "max_rollbacks"):
            _positive_int("guard", name, getattr(self, name), minimum=0)
        if _together() and self.min_history > self.window:  # the window never holds that many: never checked
            raise ConfigError(
                "guard.min_history",
                f"{self.min_history} exceeds guard.window ({self.window}), so spike detection would never start",
                "set guard.min_history <= guard.window (0: half the window)",
            )
        for name in ("threshold", "min_loss_scale", "rollback_lr_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"guard.{name}", f"must be a positive number (got {v!r})", f"set guard.{name} > 0")
        for name in ("on_nonfinite", "on_spike", "on_scale_collapse"):
            _choice("guard", name, getattr(self, name), GUARD_ACTIONS)
        for item in self.inject:
            kind, _, at = str(item).partition("@")
            if kind not in INJECT_KINDS or not (at.isascii() and at.isdigit()) or int(at) < 1:
                raise ConfigError(
                    "guard.inject",
                    f"{item!r} is not KIND@STEP",
                    f"KIND is one of {', '.join(INJECT_KINDS)}; e.g. nan-loss@5",
                )


LORA_TARGET_SETS = ("attention", "all-linear")


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scaling numerator: updates are scaled by alpha / r
    dropout: float = 0.05  # dropout on the LoRA input
    # module names, or a set expanded for the architecture (resolve.py): "attention" (the default,
    # Hu et al. 2021): q_proj and v_proj, or the fused qkv; "all-linear" (QLoRA's recipe,
    # Dettmers et al. 2023): every linear layer of a decoder layer
    target_modules: list[str] = field(default_factory=lambda: ["attention"])

    def __post_init__(self) -> None:
        _positive_int("lora", "r", self.r)
        _fraction("lora", "dropout", self.dropout)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise ConfigError("lora.alpha", f"must be positive (got {self.alpha!r})", "set lora.alpha > 0, e.g. 2*r")
        if not self.target_modules or not all(isinstance(m, str) for m in self.target_modules):
            raise ConfigError(
                "lora.target_modules",
                "must be a non-empty list of module names",
                'e.g. target_modules = ["q_proj", "v_proj"]',
            )
        blank = [m for m in self.target_modules if not m.strip() or m != m.strip()]
        if blank:
            raise ConfigError(
                "lora.target_modules",
                f"holds {'an empty' if not blank[0].strip() else 'a padded'} module name ({blank[0]!r})",
                'give module names as the model writes them, e.g. ["q_proj", "v_proj"]',
            )


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"  # adamw | adamw-8bit | sgd | sgd-momentum | adafactor
    implementation: str = "auto"  # auto: foreach on GPUs, for-loop on CPU (torch's own default)
    lr: float = 1e-4  # peak learning rate
    weight_decay: float = 0.0  # decoupled weight decay (AdamW)
    # torchtune's optimizer_in_bwd: one optimizer per parameter, stepped as its gradient is formed in
    # backward, which frees the gradient at once (no clipping, no accumulation, one process)
    step_in_backward: bool = False

    def __post_init__(self) -> None:
        _choice("optim", "name", self.name, OPTIMIZERS)
        _choice("optim", "implementation", self.implementation, OPTIM_IMPLS)
        if not isinstance(self.step_in_backward, bool):
            raise ConfigError(
                "optim.step_in_backward",
                f"must be true or false (got {self.step_in_backward!r})",
                "write true or false",
            )
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or not 0 < self.lr < math.inf:
            raise ConfigError("optim.lr", f"must be positive (got {self.lr!r})", "set optim.lr, e.g. 1e-4")
        if self.lr < MIN_LR:  # fp32 states: below its smallest normal number an update is 0 or denormal
            raise ConfigError(
                "optim.lr", f"{self.lr!r} is below fp32's smallest normal number ({MIN_LR:.3g})", "set e.g. 1e-4"
            )
        wd = self.weight_decay
        if isinstance(wd, bool) or not isinstance(wd, int | float) or wd < 0:
            raise ConfigError(
                "optim.weight_decay", f"must be >= 0 (got {self.weight_decay!r})", "set optim.weight_decay, e.g. 0.01"
            )


@dataclass(kw_only=True)
class BatchConfig:
    micro_batch_size: int | None = None  # per device; default 1 unless derivable
    grad_accum_steps: int | None = None  # micro-batches per optimizer step; default from the global batch
    global_batch_size: int | None = None  # sequences per optimizer step, all ranks
    seq_len: int = 512  # tokens per sequence (inference: prompt + generated context)

    def __post_init__(self) -> None:
        _positive_int("batch", "micro_batch_size", self.micro_batch_size, optional=True)
        _positive_int("batch", "grad_accum_steps", self.grad_accum_steps, optional=True)
        _positive_int("batch", "global_batch_size", self.global_batch_size, optional=True)
        _positive_int("batch", "seq_len", self.seq_len)


@dataclass(kw_only=True)
class ParallelConfig:
    strategy: str = "ddp"  # how data-parallel replicas share state; irrelevant at dp=1
    tp: int = 1  # tensor-parallel degree (train runs it alone and 2-D under FSDP2)
    pp: int = 1  # pipeline-parallel degree (train runs it alone: every rank a stage)
    # context-parallel degree: each rank holds 1/cp of every sequence, and attention takes the whole sequence
    # for 1/cp of the heads (DeepSpeed-Ulysses' all-to-all); alone or under FSDP2 over the dp x cp ranks
    cp: int = 1
    # parameter shards, gradients and the optimizer step in host memory (FSDP2 CPUOffloadPolicy; planned as
    # ZeRO-Offload for ddp / zero1 / zero2, which train refuses)
    offload_optimizer: bool = False
    # a collective that waits this long for a peer ends every waiting rank with an error naming it
    # (torch's default is 30 minutes)
    timeout_s: int = 600

    def __post_init__(self) -> None:
        _choice("parallel", "strategy", self.strategy, STRATEGIES)
        _positive_int("parallel", "timeout_s", self.timeout_s)
        if self.strategy == "fsdp":
            self.strategy = "zero3"
        _positive_int("parallel", "tp", self.tp)
        _positive_int("parallel", "pp", self.pp)
        _positive_int("parallel", "cp", self.cp)


@dataclass(kw_only=True)
class MemoryConfig:
    # recompute layers in backward instead of saving their activations: false | true (every layer) |
    # N (the first N decoder layers) | "auto" (the fewest layers that fit every device's budget)
    activation_checkpointing: bool | int | str = False
    # what a checkpointed layer keeps: "full" its input only (recomputes everything); "selective" also its
    # matmul and attention outputs (recomputes the norms, activations and RoPE: less recompute, more memory)
    checkpointing_policy: str = "full"
    attention: str = "auto"  # auto: sdpa where transformers supports it for the model, else eager
    # the saved tensors of the layers not checkpointed go to host memory in forward and come back for
    # backward: false | true | "pinned" (page-locked host buffers: faster copies, rounded up by the allocator)
    offload_activations: bool | str = False
    # each decoder layer's MLP computed in tiles of the sequence under recompute (ALST's TiledMLP): the
    # (tokens x intermediate) tensors exist for one tile at a time; the MLP's input is what a layer keeps of it
    tiled_mlp: bool = False
    # the CUDA caching allocator maps pages into one growing range per pool (PYTORCH_CUDA_ALLOC_CONF=
    # expandable_segments:True), so freed blocks merge whatever their order: train sets it unless the
    # variable is already set, and the plan's allocator reserve follows this setting
    expandable_segments: bool = True

    def __post_init__(self) -> None:
        _choice("memory", "attention", self.attention, ATTENTIONS)
        if not isinstance(self.tiled_mlp, bool):
            raise ConfigError(
                "memory.tiled_mlp", f"must be true or false (got {self.tiled_mlp!r})", "use true or false"
            )
        if not isinstance(self.expandable_segments, bool):
            raise ConfigError(
                "memory.expandable_segments",
                f"must be true or false (got {self.expandable_segments!r})",
                "use true or false",
            )
        if not (isinstance(self.offload_activations, bool) or self.offload_activations == "pinned"):
            raise ConfigError(
                "memory.offload_activations",
                f"unknown value {self.offload_activations!r}",
                'use false, true, or "pinned"',
            )
        _choice("memory", "checkpointing_policy", self.checkpointing_policy, ("full", "selective"))
        ac = self.activation_checkpointing
        if isinstance(ac, str) and ac in ("none", "full"):
            self.activation_checkpointing = ac == "full"
        elif not (isinstance(ac, bool) or ac == "auto" or (isinstance(ac, int) and ac >= 0)):
            raise ConfigError(
                "memory.activation_checkpointing",
                f"unknown value {ac!r}",
                'use false, true (every layer), a number of layers N, or "auto" (the fewest that fit)',
            )
        elif isinstance(ac, int) and not isinstance(ac, bool) and ac == 0:
            self.activation_checkpointing = False


@dataclass(kw_only=True)
class HardwareConfig:
    gpus: str = "auto"  # "8xH100-80GB", "A100-80GB,RTX4090", "2x24GiB", "cpu", "auto"
    gpu_mem: str | None = None  # overrides the capacity of every GPU, e.g. "24GiB"
    # a cap on every device's bill, e.g. "20GiB": the verdict and memory.activation_checkpointing = "auto"
    # fit under it, and accept checks each device's measured peak against it
    memory_budget: str | None = None
    host_mem: str | None = None  # host RAM per node for offloaded states; default: this machine's
    cuda_context_mib: int = 600  # CUDA context + kernel images, per GPU process
    # the caching allocator's bytes that no tensor owns: cuBLAS and cuBLASLt workspaces, 32 MiB each on
    # Hopper; 66-77 MiB measured at the start of every H200 row (torch 2.11, docs/gpu-validation.md)
    cublas_workspace_mib: int = 64
    cpu_runtime_mib: int = 512  # python + torch libraries in a CPU process
    # cached-but-unused allocator memory, a fraction of the peak allocated; None: the worst measured for
    # the workload class (plan/fragmentation.py)
    allocator_reserve: float | None = None
    safety_margin: float = 0.0  # extra fraction of capacity kept free for the verdict
    # what one device costs an hour (any currency; `advise --price` sets it): advise's cost column is
    # the estimated run time x devices x this; 0: no cost column (no price table is shipped)
    price_per_gpu_hour: float = 0.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.price_per_gpu_hour, bool)
            or not isinstance(self.price_per_gpu_hour, int | float)
            or not 0 <= self.price_per_gpu_hour < float("inf")
        ):
            raise ConfigError(
                "hardware.price_per_gpu_hour",
                f"must be a number >= 0 (got {self.price_per_gpu_hour!r})",
                "e.g. hardware.price_per_gpu_hour = 2.49 (0: no cost column)",
            )
        for name in ("cuda_context_mib", "cublas_workspace_mib", "cpu_runtime_mib"):
            _positive_int("hardware", name, getattr(self, name), minimum=0, maximum=MAX_RUNTIME_MIB)
        if self.allocator_reserve is not None:
            _fraction("hardware", "allocator_reserve", self.allocator_reserve)
        _fraction("hardware", "safety_margin", self.safety_margin, top=0.9)


@dataclass(kw_only=True)
class RunConfig:
    mode: str = "full"  # full | lora | qlora | inference
    # auto (amp-bf16 on GPUs that have bf16, amp-fp16 on those that do not, fp32 on the CPU) | fp32 | amp-bf16
    # | amp-fp16 | bf16 (pure bf16 weights and states)
    precision: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        _choice("run", "mode", self.mode, MODES)
        _choice("run", "precision", self.precision, PRECISIONS)

    def at_seq_len(self, seq_len: int) -> RunConfig:
        """This config with rows of seq_len tokens: a micro-batch shape the data gives (plan --data, the
        preflight and accept for one document a row)."""
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, seq_len=seq_len))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTION_TYPES = {
    "model": ModelConfig,
    "lora": LoraConfig,
    "optim": OptimConfig,
    "batch": BatchConfig,
    "parallel": ParallelConfig,
    "memory": MemoryConfig,
    "hardware": HardwareConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "guard": GuardConfig,
}
_TOP_KEYS = ("mode", "precision")
