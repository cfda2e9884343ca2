"""train.compile: what a compiled decoder layer saves for backward.

torch.compile hands a layer's forward and backward to AOTAutograd as one joint graph, and inductor's
partitioner (a min cut over that graph) decides which of its tensors the forward saves: it recomputes
cheap element-wise ops in backward (an activation's output, a norm's normalized input, dropout's
noise becomes a bool mask) instead of saving them. On the tiny LoRA model at micro-batch 4 x seq 256
a compiled layer saves 26 % less than the eager one. The plan asks that partitioner rather than
guessing it: the real transformers model, with 2 layers, is built as the engine builds it, its layers
compiled with inductor's decompositions, joint-graph passes and partitioner (the graphs then run
uncompiled, on fake tensors: no code is generated, nothing is allocated), and the tensors each
layer's forward saves are summed. As in plan/derived.py, four (micro-batch, seq) points fit

    saved(b, s) = a * b * s + c * b * s^2 + e * s + d

per layer, cached per architecture and settings under the user cache, so a warm plan imports no
torch. The rest of the bill (weights, optimizer, the head and loss, backward's temporaries) stays
the eager step's: docs/memory-model.md says what that leaves out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json

from trainplan.errors import ConfigError, TrainplanError
from trainplan.plan import derived
from trainplan.plan.derived import POINTS, LayerFit, _target, _write

VERSION = 1  # bump when the capture or the fit changes


@dataclasses.dataclass(frozen=True)
class CompiledFits:
    """One compiled layer's saved bytes: the first layer, whose input needs no gradient under LoRA
    (`first`), and every other (`rest`)."""

    first: LayerFit
    rest: LayerFit


def _key(r) -> dict:
    """What a compiled layer's saved tensors depend on: what the derived terms' do, whether FSDP2 runs
    the layers (its mixed precision replaces autocast), and the versions of torch (its partitioner
    decides), transformers and peft (the layer's code)."""
    return {**derived._key(r), "compiled": VERSION, "fsdp": r.dims.shards_params, **_versions()}


@functools.cache
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {name: version(name) for name in ("torch", "transformers", "peft")}
    except PackageNotFoundError as e:
        raise ConfigError(
            "train.compile",
            f"planning a compiled step compiles the model's layers, and {e.name} is not installed",
            "install trainplan[run], or plan with train.compile=false",
        ) from None


_FITS: dict[str, CompiledFits] = {}  # this process's fits by cache file: the advisor plans many micro-batches


def fits(r) -> CompiledFits:
    """The compiled layer's fits for this job, from the cache or captured now."""
    key = _key(r)
    path = derived.cache_path(r, "compiled-", key)
    if str(path) in _FITS:
        return _FITS[str(path)]
    entry = _read_fits(path)
    if entry is None:
        try:
            points = {point: _capture(r, *point) for point in POINTS}
        except Exception as e:  # torch.compile's own failure on this architecture: named, not a traceback
            first = str(e).splitlines()[0] if str(e) else ""
            raise ConfigError(
                "train.compile",
                f"the planner could not compile {r.spec.model_type}'s layers on fake tensors "
                f"({type(e).__name__}: {first})",
                "plan with train.compile=false, or measure the compiled step with `trainplan accept`",
            ) from e
        entry = {
            "first": dataclasses.asdict(LayerFit.from_points({p: v[0] for p, v in points.items()})),
            "rest": dataclasses.asdict(LayerFit.from_points({p: v[1] for p, v in points.items()})),
            "points": {f"{b}x{s}": points[(b, s)] for b, s in POINTS},
        }
        _write(path, {**entry, "key": key})
    _FITS[str(path)] = CompiledFits(first=LayerFit(**entry["first"]), rest=LayerFit(**entry["rest"]))
    return _FITS[str(path)]


def _read_fits(path) -> dict | None:
    try:
        entry = json.loads(path.read_text())
        LayerFit(**entry["first"]), LayerFit(**entry["rest"])
        return entry
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: capture again


def _capture(r, batch: int, seq: int) -> tuple[int, int]:
    """(layer 0's, layer 1's) saved bytes at one point: the storages each compiled layer's forward
    saves for backward, each once, leaving out parameters (and views or casts of them held as such)
    and the tensors every layer is handed (the rotary tables, a mask: the plan's step inputs)."""
    import torch

    from trainplan import _torch_private as P
    from trainplan.features.torch_compile import engine as torch_compile
    from trainplan.run import build, converter, step

    rr = derived.shallow_job(r, batch, seq, 2)
    model = build.build_model(rr.spec, rr.cfg, rr.precision)
    # FSDP2's MixedPrecisionPolicy computes in the compute dtype without autocast (params, adapters and
    # the residual stream 16-bit): the layers run so here
    fsdp_precision = r.dims.shards_params and rr.precision.autocast
    if fsdp_precision:
        model.to(converter.dtypes(rr.precision).compute)  # on the meta device, before the fake tensors exist
    with P.fake_mode():
        build.allocate(model, "cpu")
        ids = torch.randint(0, r.spec.vocab_size, (batch, seq))
    model.train()
    layers = converter.decoder_layers(model)
    backend = P.partitioned_backend()
    graphs = []

    def counted(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    # this process's earlier compiles of the layer's code would count toward its recompile limit,
    # past which torch.compile runs the layer eagerly: the capture starts from none
    P.forget_compiled()
    torch_compile.compile_layers(model, backend=counted, dynamic=False)
    skip = {id(p.untyped_storage()) for p in model.parameters()}
    saved: list[dict[int, int]] = [{} for _ in layers]
    current: list[int | None] = [None]

    def enter(i: int, args: tuple, kwargs: dict) -> None:
        """Every tensor a layer is handed but its hidden states (the first argument, or by name)."""
        current[0] = i
        given = [*args[1:], *(v for k, v in kwargs.items() if k != "hidden_states")]
        if not args and "hidden_states" not in kwargs:
            raise AssertionError("a decoder layer called without its hidden states")
        for value in given:
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    skip.add(id(t.untyped_storage()))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()  # alive while saved: its id is its own
        if current[0] is not None and id(storage) not in skip:
            saved[current[0]][id(storage)] = storage.nbytes()
        return t

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, kw, i=i: enter(i, a, kw), with_kwargs=True)
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    kernels = P.cuda_kernels() if _target(r) == "cuda" else contextlib.nullcontext()
    try:
        autocast = contextlib.nullcontext() if fsdp_precision else step.autocast(rr.precision, "cpu")
        with P.unpacked_sequences(), kernels, autocast:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=ids)
    finally:
        P.forget_compiled()  # nor should the capture's count toward a later run's
    # dynamo's cache was emptied above, so its recompile limit (8 entries per code object; here at most 2,
    # the layer's input requiring a gradient or not) cannot send a layer back to eager; a layer it
    # could not compile at all leaves no graph
    if not graphs:
        raise TrainplanError("train.compile: torch.compile ran the planner's layers eagerly: no compiled plan")
    return sum(saved[0].values()), sum(saved[1].values())
