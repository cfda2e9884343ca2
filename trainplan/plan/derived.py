"""Terms derived from a trace, for an architecture without hand-written ones (Qwen3, Gemma-3, the
next ones).

Everything that does not depend on a decoder layer's code stays analytic: weights, gradients and
optimizer states come from the parameter layout the real module lists (built on the meta device),
the embedding, head, loss and the phases around the step from the usual terms. What a decoder
layer saves for backward is measured: the real transformers model is traced on fake tensors with
1 and 2 layers at four (micro-batch, seq) points, and the difference (one layer) is fitted as

    saved(b, s) = a * b * s + c * b * s^2 + e * s + d

(per token; eager attention's scores; the rotary tables, which depend on the positions only; a
constant). Four points determine the four coefficients exactly. The fit and the layout are cached
per architecture and settings under the user cache, so a warm `plan` imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from trainplan.errors import ConfigError, in_its_words
from trainplan.features import lora
from trainplan.spec.layout import cache_dir, meta_layout

VERSION = 5  # bump when the traced step or the fit changes
POINTS = ((1, 64), (2, 64), (1, 128), (2, 128))  # (micro-batch, seq)


@dataclass(frozen=True)
class LayerFit:
    """One decoder layer's saved bytes: a * b * s + c * b * s^2 + e * s + d."""

    a: float
    c: float
    e: float
    d: float

    def nbytes(self, batch: int, seq: int) -> int:
        return max(0, round(self.a * batch * seq + self.c * batch * seq * seq + self.e * seq + self.d))

    @classmethod
    def from_points(cls, saved: dict[tuple[int, int], int]) -> LayerFit:
        (b1, s1), (b2, _), (_, s2), _ = POINTS
        assert (b2, s2) == (2 * b1, 2 * s1) and b1 == 1, POINTS  # the solution below assumes this grid
        d11, d21, d12, d22 = (saved[p] for p in POINTS)
        x, y = d21 - d11, d22 - d12  # a*s + c*s^2, 2a*s + 4c*s^2
        c = (y - 2 * x) / (2 * s1 * s1)
        a = (x - c * s1 * s1) / s1
        e = (d12 - d11 - a * s1 - 3 * c * s1 * s1) / s1
        d = d11 - a * s1 - c * s1 * s1 - e * s1
        return cls(a=a, c=c, e=e, d=d)


def cache_path(r, prefix: str, key: dict) -> Path:
    """The cache file of one key: `<prefix><model_type>-<digest>.json` under cache_dir."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir(r.cfg.model.cache_dir) / f"{prefix}{r.spec.model_type}-{digest}.json"


def _key(r) -> dict:
    """What a decoder layer's saved tensors depend on (not the batch, seq, devices' count or the
    optimizer): the architecture and the settings that change what autograd saves."""
    cfg = r.cfg
    return {
        "version": VERSION,
        "config": r.spec.config,
        "mode": cfg.mode,
        "precision": cfg.precision,
        "attention": r.attention,
        "lora": dataclasses.asdict(cfg.lora) if lora.on(cfg) else None,
        "target": _target(r),
        "tp": r.dims.tp,  # a tensor-parallel rank's layer saves its share
    }


def attach(r):
    """r with its spec's layout and layer fit filled in, from the cache or traced now."""
    spec = r.spec
    if not spec.derived or spec.layer_fit is not None:
        return r
    if r.dims.pp > 1:
        raise ConfigError(
            "parallel.pp",
            f"{spec.model_type} has no hand-written terms, and derived ones cover data and tensor parallelism only",
            "plan it with pp = 1",
        )
    key = _key(r)
    path = cache_path(r, "", key)
    entry = _read(path)
    if entry is None and r.dims.tp > 1 and _in_a_process_group():
        entry = _derive_in_its_own_process(r, path)
    if entry is None:
        entry = _derive(r)
        _write(path, {**entry, "key": key})
    fit = LayerFit(**entry["fit"])
    first = LayerFit(**entry["first_fit"]) if entry.get("first_fit") else None
    layout = tuple((name, tuple(shape)) for name, shape in entry["layout"])
    spec = dataclasses.replace(spec, layer_fit=fit, first_layer_fit=first, layout=layout)
    return dataclasses.replace(r, spec=spec)


def _in_a_process_group() -> bool:
    """A rank of a distributed run (torch already imported and its process group up)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _derive_in_its_own_process(r, path: Path) -> dict:
    """Under tensor parallelism the trace fakes the tp group's peers, which a rank of a running job, its
    own process group up, cannot: a fresh process derives the fit into the cache, this one reads it."""
    import subprocess
    import sys

    code = (
        "import json, sys; from trainplan import config as C; from trainplan.plan import derived; "
        "from trainplan.resolve import resolve; derived.attach(resolve(C.from_dict(json.loads(sys.argv[1]))))"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(r.cfg.to_dict())], capture_output=True, text=True)
    entry = _read(path)
    if proc.returncode != 0 or entry is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError("model.source", f"deriving {r.spec.model_type}'s layer terms failed: {last}", "plan it first")
    return entry


def _read(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text())
        LayerFit(**entry["fit"])
        return entry if isinstance(entry["layout"], list) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: derive again


def _write(path: Path, entry: dict) -> None:
    from trainplan.files import write_atomic

    try:
        write_atomic(path, json.dumps(entry))
    except OSError:
        pass  # an unwritable cache costs the next plan a trace, nothing else


def _derive(r) -> dict:
    """Trace 1- and 2-layer versions of the real model at the four points. One layer's saved bytes
    are the difference at the end of forward (the loss and the rest are common to both).
    Autocast's cached casts of a layer's weights (full) or adapters (LoRA) are the plan's own
    components (weight copies, adapter copy): taken out here. Under LoRA the first layer saves
    less than the others (its input needs no gradient) but is planned like them: an overestimate
    of one layer's difference, never an underestimate (a model of no layers cannot carry adapters,
    so there is nothing to trace it against)."""

    spec, cfg = r.spec, r.cfg
    _refuse_unbuildable_copies(spec)
    layout = [[name, list(shape)] for name, shape in spec.layout] if spec.layout else meta_layout(spec.config)
    casts = _layer_casts(r, layout)
    adapters = lora.on(cfg)
    layer, first = {}, {}
    for point in POINTS:
        saved = {}
        for depth, input_grads in ((1, False), (2, False), *(((2, True),) if adapters else ())):
            shallow = shallow_job(r, *point, depth)
            entering: dict = {}
            _trace(shallow, entering, input_grads)
            # at the end of forward, not at its peak: a small model's peak can sit inside a layer (its
            # MLP's temporaries), and then the peaks of 1 and 2 layers differ by less than a layer
            live = entering["backward"]
            saved[depth, input_grads] = live.get("activations", 0) + live.get("inputs", 0)
        layer[point] = saved[2, False] - saved[1, False] - casts
        if adapters:  # the first layer saves less by what it saves once its input needs a gradient
            first[point] = layer[point] - (saved[2, True] - saved[2, False])
    return {
        "fit": dataclasses.asdict(LayerFit.from_points(layer)),
        "first_fit": dataclasses.asdict(LayerFit.from_points(first)) if adapters else None,
        "layout": layout,
        "points": {f"{b}x{s}": layer[(b, s)] for b, s in POINTS},
    }


def _refuse_unbuildable_copies(spec) -> None:
    """The 1- and 2-layer copies the terms are derived from are built by transformers from the config with fewer
    layers; where it refuses one (per-layer settings that name deeper layers: Gemma-4's per_layer_config), the
    architecture cannot be derived, and that is said in one line, in transformers' words."""
    import torch
    import transformers

    for depth in (1, 2):
        try:
            hf = transformers.CONFIG_MAPPING[spec.model_type](**_with_layers(spec.config, depth))
            with torch.device("meta"):
                transformers.AutoModelForCausalLM.from_config(hf)
        except Exception as e:  # transformers' own validation of the shallow config
            raise ConfigError(
                "model.source",
                f"{spec.model_type} has no hand-written terms, and its terms cannot be derived: transformers refuses "
                f"a {depth}-layer copy of it ({in_its_words(e)})",
                "this architecture is not planned yet (per-layer settings that name deeper layers, or a value its "
                "config class validates)",
            ) from None


def _trace(shallow, entering: dict, input_grads: bool) -> None:
    """The shallow job's step on fake tensors; under tensor parallelism rank 0 of the tp split, its peers
    faked, so the layer's saved tensors are one rank's share."""
    from trainplan.plan import tracestep

    try:
        with tracestep.rank_zero(shallow.dims, shallow.dims.tp) as mesh:
            tracestep.traced_step(
                shallow,
                real=False,
                target=_target(shallow),
                world=1,
                mesh=mesh,
                entering=entering,
                input_grads=input_grads,
            )
    except Exception as e:
        where = _in_transformers(e)
        if where is None:  # trainplan's own code: an internal error, reported as one
            raise
        raise ConfigError(
            "model.source",
            f"{shallow.spec.model_type} has no hand-written terms, and its own forward fails on this config in a "
            f"{shallow.spec.num_layers}-layer copy, at {where} ({_why(e)})",
            "this architecture is not planned yet"
            if _reads_values(e)
            else "check the config's values there (a default left None, a part the model needs besides text)",
        ) from None


def _reads_values(e: BaseException) -> bool:
    return type(e).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException")


def _why(e: BaseException) -> str:
    if _reads_values(e):
        return f"it reads tensor values ({in_its_words(e, 60)}), which a trace on fake tensors holds none of"
    return in_its_words(e)


def _in_transformers(e: BaseException) -> str | None:
    """'modeling_x.py:123 in forward' where the deepest frame outside torch is transformers' own, else None."""
    import traceback

    passing = ("/torch/", "trainplan/_torch_private.py")  # torch, and the tracker's dispatch hook it passes through
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not any(p in f.filename for p in passing)]
    if not frames or "/transformers/" not in frames[-1].filename:
        return None
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}"


def shallow_job(r, batch: int, seq: int, depth: int):
    """The job with `depth` decoder layers at (micro-batch, seq) on one device (one tensor-parallel group
    under tp): random weights, no accumulation, checkpointing or offload, plain data parallelism (what a
    layer's saved tensors are measured on)."""
    from trainplan import resolve as R

    cfg, spec, tp = r.cfg, r.spec, r.dims.tp
    device = r.devices[0].name if r.devices[0].is_gpu else "cpu"
    reduced = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, init="random"),
        batch=dataclasses.replace(
            cfg.batch, micro_batch_size=batch, seq_len=seq, grad_accum_steps=1, global_batch_size=None
        ),
        memory=dataclasses.replace(cfg.memory, activation_checkpointing=False, offload_activations=False),
        parallel=dataclasses.replace(cfg.parallel, strategy="ddp", tp=tp, pp=1, offload_optimizer=False),
        hardware=dataclasses.replace(cfg.hardware, gpus=f"{tp}x{device}" if tp > 1 else device),
    )
    return R.resolve(reduced, dataclasses.replace(spec, num_layers=depth, config=_with_layers(spec.config, depth)))


def _layer_casts(r, layout: list) -> int:
    """Bytes of autocast's cached casts for one decoder layer: its trainable matmul weights (full
    fine-tuning) or its adapters (LoRA), each cast once to the compute dtype."""
    cfg, prec = r.cfg, r.precision
    if not prec.autocast or cfg.mode == "inference":
        return 0
    from trainplan.plan.tensors import ROWWISE, _tp_numel
    from trainplan.spec.model import _from_layout

    one = [_from_layout(name, shape) for name, shape in layout]
    one = [t for t in one if t.layer == 0]
    tp = r.dims.tp  # a tensor-parallel rank casts its shards: lora_A splits a row-wise layer's input
    if cfg.mode == "full":
        return sum(_tp_numel(t, tp) for t in one if t.role in ("linear", "bias")) * prec.compute_bytes
    targets = set(cfg.lora.target_modules)
    adapters = sum(
        cfg.lora.r * (t.shape[1] // tp + t.shape[0])
        if t.module in ROWWISE
        else cfg.lora.r * (t.shape[1] + t.shape[0] // tp)
        for t in one
        if t.role == "linear" and t.module in targets
    )
    return adapters * prec.compute_bytes


def _target(r) -> str:
    return "cuda" if r.devices[0].is_gpu else "cpu"


def _with_layers(config: dict, depth: int) -> dict:
    """The config with `depth` decoder layers; per-layer lists (Gemma-3's layer_types) cut to match."""
    n = config["num_hidden_layers"]
    out = {k: ((v * depth)[:depth] if isinstance(v, list) and len(v) == n else v) for k, v in config.items()}
    out["num_hidden_layers"] = depth
    return out
