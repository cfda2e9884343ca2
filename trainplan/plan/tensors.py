"""Per-rank tensor arithmetic for the analytic plan: which parameter tensors a rank holds, their
shards under TP and FSDP, LoRA shapes, and the optimizer's state and temporaries. Imports no torch.
"""

from __future__ import annotations

from trainplan.features import optim8bit
from trainplan.spec.devices import MiB
from trainplan.spec.model import ModelSpec, ParamTensor
from trainplan.spec.parallel import ParallelDims

ROWWISE = frozenset({"o_proj", "down_proj", "c_proj"})  # TP shards their input dim
NF4_BYTES = 0.5
# bitsandbytes NF4 with double quantization: one 8-bit absmax per 64 weights, plus one fp32
# constant per 256 absmax blocks (Dettmers et al. 2023, QLoRA, Sec. 3).
NF4_CONSTANTS_BYTES = 1 / 64 + 4 / (64 * 256)
ZERO2_BUCKET_BYTES = 25 * MiB  # torch DDP's default bucket_cap_mb
BNB_8BIT_MIN_NUMEL = 4096  # bitsandbytes keeps 32-bit states for smaller tensors (min_8bit_size)
BNB_BLOCK = 256  # blockwise quantization of optimizer states, one fp32 absmax per block
BNB_QMAP_BYTES = 2 * 256 * 4  # the signed and unsigned dynamic maps (256 fp32 codes each) of one optimizer


# ---- per-rank tensors ----------------------------------------------------------------------


def _held(spec: ModelSpec, dims: ParallelDims, stage: int) -> list[ParamTensor]:
    """Parameter tensors a pipeline stage holds. A tied embedding lives on both end stages."""
    layers = dims.stage_layers(stage, spec.num_layers)
    first, last = stage == 0, stage == dims.pp - 1
    held = []
    for t in spec.tensors:
        if t.layer is not None:
            if t.layer in layers:
                held.append(t)
        elif t.role in ("embedding", "position"):
            if first or (t.role == "embedding" and last and spec.tie_word_embeddings):
                held.append(t)
        elif last:
            held.append(t)
    return held


def _cast(t: ParamTensor, stage: StageTensors, fused_loss: bool, last: bool) -> bool:
    """Whether autocast casts this trainable tensor. Only matmul weights: embedding lookups and norm
    multiplies run in fp32, experts' grouped matmuls are outside autocast, and the fused loss casts
    the head per call."""
    return (
        t.role in ("linear", "bias", "router")
        or (t.role == "lm_head" and not fused_loss)
        or (t.role == "embedding" and stage.spec.tie_word_embeddings and last and not fused_loss)
    )


# The subsets of a stage's tensors that sums run over: name -> predicate(t, stage, *arguments).
_SUBSETS = {
    "held": lambda t, stage: True,
    "root": lambda t, stage: t.layer is None,  # FSDP's root unit: embedding, final norm, head
    "quantizable": lambda t, stage: t.role in ("linear", "expert"),  # QLoRA's NF4 weights
    "unquantized": lambda t, stage: t.role not in ("linear", "expert"),
    "embedding": lambda t, stage: t.role == "embedding",
    "lm_head": lambda t, stage: t.role == "lm_head",
    # the first layer's tensors and an untied embedding: their gradients are formed last
    "first_layer": lambda t, stage: (
        (bool(stage.layers) and t.layer == stage.layers[0])
        or (t.role == "embedding" and not stage.spec.tie_word_embeddings)
    ),
    # the final norm and the top layer's MLP down projection: their gradients are formed first
    "top_down": lambda t, stage: (
        (t.layer is None and t.role == "norm")
        or (
            bool(stage.layers)
            and t.layer == stage.layers[-1]
            and ".mlp." in t.name
            and t.module in ("down_proj", "c_proj")
        )
    ),
    "cast": _cast,  # (fused_loss, last)
    # the casts outside the first n (checkpointed) layers, and those of `layer` (fused_loss, last, n, layer)
    "cast_kept": lambda t, stage, fused, last, n, layer: (
        _cast(t, stage, fused, last) and (t.layer is None or t.layer >= n or t.layer == layer)
    ),
    # the gradients not yet formed when layer n's backward ends: the layers below it and an untied
    # embedding (n)
    "below": lambda t, stage, n: (
        (t.layer is not None and t.layer < n) or (t.role == "embedding" and not stage.spec.tie_word_embeddings)
    ),
    "cast_in_layer": lambda t, stage, fused, last, layer: _cast(t, stage, fused, last) and t.layer == layer,
}


class StageTensors:
    """The parameter tensors one pipeline stage holds, with sums over them memoized by subset,
    tensor-parallel degree and shard count. One plan asks for a dozen such sums per rank, and the
    advisor plans the same stage under a thousand settings: each sum walks the tensors once per
    model. Kept in the (frozen) spec's memo by `stage_tensors`."""

    def __init__(self, spec: ModelSpec, dims: ParallelDims, stage: int):
        self.spec = spec
        self.layers = dims.stage_layers(stage, spec.num_layers)
        self.held = tuple(_held(spec, dims, stage))
        self._memo: dict[tuple, object] = {}

    def memo(self, key: tuple, compute):
        """compute(), once per key."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute()
            return value

    def select(self, which: str | tuple) -> tuple[ParamTensor, ...]:
        """The subset `which`: a name in _SUBSETS, or (name, *arguments)."""
        name, *args = (which,) if isinstance(which, str) else which
        keep = _SUBSETS[name]
        return self.memo(("select", which), lambda: tuple(t for t in self.held if keep(t, self, *args)))

    def numel(self, which: str | tuple, tp: int, shard: int = 1) -> int:
        """Elements of the subset on one rank: tensor-parallel shards, then FSDP's `shard` ways."""
        return self.memo(
            ("numel", which, tp, shard), lambda: sum(_sharded_numel(t, tp, shard) for t in self.select(which))
        )

    def largest(self, which: str | tuple, tp: int) -> int:
        """The largest tensor of the subset on one tensor-parallel rank, in elements."""
        return self.memo(("largest", which, tp), lambda: max((_tp_numel(t, tp) for t in self.select(which)), default=0))

    def shapes(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """Every held tensor's shape on one tensor-parallel rank."""
        return self.memo(("shapes", tp), lambda: tuple(_shape_tp(t, tp) for t in self.held))

    def lora_shapes(self, r: int, targets: frozenset[str], tp: int) -> tuple[tuple[int, ...], ...]:
        """The stage's LoRA adapter tensors, tensor-parallel shards."""
        return self.memo(("lora", r, targets, tp), lambda: tuple(_lora_shapes(self.spec, r, targets, self.layers, tp)))

    def lora_numel(self, r: int, targets: frozenset[str], tp: int, *, largest: bool = False) -> int:
        """The stage's adapter elements on one tensor-parallel rank, or its largest adapter tensor's."""

        def compute() -> int:
            numels = [_numel(s) for s in self.lora_shapes(r, targets, tp)]
            return max(numels, default=0) if largest else sum(numels)

        return self.memo(("lora numel", r, targets, tp, largest), compute)


def stage_tensors(spec: ModelSpec, dims: ParallelDims, stage: int) -> StageTensors:
    """The stage's tensors, computed once per spec, pipeline degree and stage."""
    key = ("stage", dims.pp, stage)
    if key not in spec.memo:
        spec.memo[key] = StageTensors(spec, dims, stage)
    return spec.memo[key]


def _tp_numel(t: ParamTensor, tp: int) -> int:
    if tp == 1 or t.role in ("norm", "router"):
        return t.numel
    if t.role == "bias" and t.module in ROWWISE:
        return t.numel
    return -(-t.numel // tp)


def _shard(numel_dim0: int, rest: int, n: int) -> int:
    """FSDP2 shards dim 0, padding it to a multiple of the shard count."""
    return -(-numel_dim0 // n) * rest


def _sharded_numel(t: ParamTensor, tp: int, dp: int) -> int:
    numel = _tp_numel(t, tp)
    if dp == 1:
        return numel
    dim0 = t.shape[0] if t.numel == numel else max(1, t.shape[0] // tp)
    return _shard(dim0, numel // max(dim0, 1), dp)


def _shape_tp(t: ParamTensor, tp: int) -> tuple[int, ...]:
    numel = _tp_numel(t, tp)
    if numel == t.numel:
        return t.shape
    return (t.shape[0], numel // t.shape[0]) if len(t.shape) > 1 else (numel,)


def _lora_shapes(spec: ModelSpec, r: int, targets: frozenset[str], layers: range, tp: int) -> list[tuple[int, ...]]:
    layer = []  # every layer's adapters have the same shapes
    for lin in spec.layer_linears:
        if lin.module in targets:
            rowwise = lin.module in ROWWISE
            layer.append((r, lin.in_features // (tp if rowwise else 1)))  # lora_A
            layer.append((lin.out_features // (1 if rowwise else tp), r))  # lora_B
    return layer * len(layers)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- optimizer -------------------------------------------------------------------------------


def zero1_partition(shapes: list[tuple[int, ...]], world: int) -> list[list[tuple[int, ...]]]:
    """Which tensors' optimizer states each rank holds under torch's ZeroRedundancyOptimizer:
    largest first, each to the rank with the fewest elements so far (not an even split: one large
    embedding can put most of the states on one rank)."""
    parts: list[list[tuple[int, ...]]] = [[] for _ in range(world)]
    sizes = [0] * world
    for shape in sorted(shapes, key=_numel, reverse=True):
        i = sizes.index(min(sizes))
        parts[i].append(shape)
        sizes[i] += _numel(shape)
    return parts


def optimizer_state_bytes(
    name: str, shapes: list[tuple[int, ...]], state_bytes: int, cpu: bool, *, in_backward: bool = False
) -> int:
    """Optimizer state for the trainable tensors `shapes`.

    AdamW: exp_avg + exp_avg_sq in the param dtype (Loshchilov & Hutter 2019; torch.optim.AdamW),
    plus a `step` scalar per tensor, kept on the CPU (fp32) unless capturable/fused.
    8-bit AdamW (bitsandbytes 0.50 AdamW8bit, optim/optimizer.py `Optimizer2State.init_state`):
    two uint8 states + two fp32 absmax per 256-element block; tensors under 4096 elements
    (min_8bit_size) keep two fp32 states whatever the param dtype; `step` is a Python int; the two
    256-code quantization maps are shared by every tensor of one optimizer, so once per
    optimizer with an 8-bit tensor (`in_backward`: one optimizer per tensor). SGD with momentum:
    one buffer. Adafactor (torch.optim.Adafactor): factored second moment, row + column vectors
    for matrices, a full vector otherwise; no first moment.
    """
    steps = 4 * len(shapes) if cpu else 0
    numel = sum(_numel(s) for s in shapes)
    if name == "adamw":
        return 2 * numel * state_bytes + steps
    if name == "sgd":
        return 0
    if name == "sgd-momentum":
        return numel * state_bytes
    if optim8bit.is_8bit(name):
        total, quantized = 0, 0
        for s in shapes:
            n = _numel(s)
            if n < BNB_8BIT_MIN_NUMEL:
                total += 2 * n * 4
            else:
                total += 2 * n + 2 * 4 * -(-n // BNB_BLOCK)
                quantized += 1
        return total + BNB_QMAP_BYTES * (quantized if in_backward else min(quantized, 1))
    if name == "adafactor":
        total = 0
        for s in shapes:
            if len(s) >= 2:
                total += (_numel(s[:-1]) + _numel(s[:-2]) * s[-1]) * state_bytes
            else:
                total += _numel(s) * state_bytes
        return total + steps
    raise AssertionError(name)


def optimizer_temp_bytes(
    name: str, impl: str, shapes: list[tuple[int, ...]], state_bytes: int, *, cpu: bool = False
) -> int:
    """Temporaries alive inside optimizer.step().

    torch's foreach AdamW (the default on CUDA) computes sqrt(exp_avg_sq) for every tensor at
    once: one full-size temporary list (torch/optim/adamw.py, `_multi_tensor_adam`). The
    single-tensor loop (the default on CPU) holds sqrt() and its division for the largest
    tensor. Fused kernels need none. 8-bit AdamW ignores `impl`: see `bnb_cpu_temp_bytes`.
    """
    if optim8bit.is_8bit(name):
        return max((bnb_cpu_temp_bytes(_numel(s), state_bytes) for s in shapes), default=0) if cpu else 0
    if not shapes or name == "sgd" or impl == "fused":
        return 0
    if impl == "foreach":
        return sum(_numel(s) for s in shapes) * state_bytes if name.startswith("adamw") else 0
    if name not in ("adamw", "adafactor"):
        return 0
    # `denom = (exp_avg_sq.sqrt() / c).add_(eps)`: sqrt and quotient of this tensor, while the
    # previous tensor's denom is still bound to the loop variable.
    sizes = [_numel(s) * state_bytes for s in shapes]
    return max(2 * cur + prev for prev, cur in zip([0, *sizes[:-1]], sizes, strict=True))


def bnb_cpu_temp_bytes(n: int, param_bytes: int) -> int:
    """bitsandbytes' AdamW8bit step on one tensor of n elements. On CUDA one fused kernel updates
    the states in place: nothing. Its CPU backend (backends/cpu/ops.py, 0.50) dequantizes both
    states to fp32, takes the gradient as fp32 (`g.float() * gnorm_scale`, a new tensor) and forms
    `(state2.sqrt() / c).add_(eps)`: five fp32 tensors of n at once; a 16-bit parameter adds its
    fp32 copy. Tensors under min_8bit_size take the 32-bit path: the gradient copy, then
    `state2.sqrt() + eps` and the quotient, three."""
    upcast = 4 * n if param_bytes != 4 else 0
    return (5 if n >= BNB_8BIT_MIN_NUMEL else 3) * 4 * n + upcast
