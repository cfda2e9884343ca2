"""Weights and tokenizer for a run: pretrained (HF directory, GGUF converted once to a safetensors
cache, the embedded default) or random initialization (presets, config.json)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from trainplan import _torch_private, features
from trainplan.config import RunConfig
from trainplan.errors import ConfigError, TrainplanError
from trainplan.features.qlora import engine as qlora
from trainplan.files import safetensors_header
from trainplan.run import build, experts
from trainplan.spec import hub
from trainplan.spec.model import ModelSpec, default_gguf_path, model_dir
from trainplan.spec.precision import Precision

LOG = logging.getLogger("trainplan")  # the progress lines' logger (run/progress.py)


def is_pretrained(cfg: RunConfig) -> bool:
    """Whether the run loads weights. Random weights only when asked (model.init = "random"): a
    preset or a config.json describes an architecture and carries no weights, and fine-tuning a
    random model is a silent wrong answer (held-out loss ~11 where the real model has ~0.8)."""
    source = cfg.model.source
    if cfg.model.init == "random":
        return False
    if source == "default" or source.endswith(".gguf") or model_dir(source) is not None:
        return True
    if hub.looks_like_hub_id(source):
        raise ConfigError(
            "model.source",
            f"{source!r} is not in the local Hugging Face cache: only its architecture is known (a preset)",
            hub.download_fix(source) + '; or set model.init = "random" to train from scratch',
        )
    raise ConfigError(
        "model.source",
        f"{source!r} describes an architecture but carries no weights, so training would start from random ones",
        "point model.source at a local model directory, a Hub id in the local cache or a .gguf holding its weights "
        '(e.g. `hf download ORG/NAME`), or set model.init = "random" to train from scratch',
    )


def _gguf(cfg: RunConfig) -> Path | None:
    if cfg.model.source == "default":
        return default_gguf_path()
    return Path(cfg.model.source) if cfg.model.source.endswith(".gguf") else None


WHOLE = ("model.safetensors", "tokenizer.json")  # a GGUF's whole conversion holds these


def _whole(gguf: Path, cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / f"{gguf.stem}-{gguf.stat().st_size}"


def gguf_cache(gguf: Path, cache_dir: str) -> Path:
    """Dequantize a GGUF file once into a safetensors model directory (written atomically)."""
    return _converted(gguf, _whole(gguf, cache_dir), _dequantize, "safetensors", WHOLE)


def gguf_tokenizer(gguf: Path, cache_dir: str) -> Path:
    """The GGUF file's tokenizer alone, once, in a directory of its own (written atomically): a run that
    only tokenizes (a random-init model) need not dequantize the weights (about 5 s against 25 s for
    the embedded default). Where the whole model is converted already, its directory serves."""
    whole = _whole(gguf, cache_dir)
    if _holds(whole, WHOLE):
        return whole
    return _converted(
        gguf, whole.with_name(whole.name + "-tokenizer"), _tokenizer_only, "a tokenizer", ("tokenizer.json",)
    )


def _converted(gguf: Path, target: Path, convert, what: str, needs: tuple[str, ...]) -> Path:
    """`target`, converted from `gguf` by `convert(gguf, out)` unless it holds the files `needs` already;
    published by one rename, so concurrent converters (torchrun ranks, test workers) keep one copy."""
    if _holds(target, needs):
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    LOG.info("convert GGUF %s to %s in %s (once; later runs read it) ...", gguf.name, what, target)
    piped = not sys.stderr.isatty()  # a stage line then, not bars redrawn with \r
    with _torch_private.no_gguf_bars() if piped else contextlib.nullcontext():
        convert(gguf, tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not _holds(target, needs):  # else another process (a torchrun rank, a test worker) finished first: keep its copy
        shutil.rmtree(target, ignore_errors=True)  # a partial leftover
        try:
            os.replace(tmp, target)
        except OSError:  # ENOTEMPTY: another process published between the check and the rename
            if not _holds(target, needs):
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    LOG.info("convert GGUF done in %.1fs", time.perf_counter() - t0)
    return target


def _holds(directory: Path, names: tuple[str, ...]) -> bool:
    return all((directory / name).is_file() for name in names)


def _dequantize(gguf: Path, out: Path) -> None:
    """The GGUF file's model and tokenizer, saved to `out` as a dequantized safetensors directory."""
    import transformers

    with _gguf_errors(gguf):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    model.hf_quantizer = None  # the weights are dequantized; nothing is quantized any more
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    _tokenizer_only(gguf, out)


def _tokenizer_only(gguf: Path, out: Path) -> None:
    import transformers

    with _gguf_errors(gguf):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _gguf_errors(gguf: Path):
    try:
        yield
    except Exception as e:  # transformers raises assorted errors on a corrupt or unsupported file
        raise ConfigError(
            "model.source",
            f"cannot load GGUF {str(gguf)!r} ({type(e).__name__}: {e})".splitlines()[0],
            "pass a valid GGUF file of a supported architecture",
        ) from None


def weights_dir(cfg: RunConfig) -> Path | None:
    gguf = _gguf(cfg)
    if gguf is not None:
        return gguf_cache(gguf, cfg.model.cache_dir)
    return model_dir(cfg.model.source)


def base_reference(cfg: RunConfig) -> str | None:
    """Where the exact base weights of a run load from, for whoever loads its result: the Hub id when
    they are the Hub's (in the local cache), else the directory trainplan loaded them from (for a GGUF,
    the embedded default among them, its dequantized safetensors directory, with the tokenizer).
    None for random weights (model.init = "random"): they were never saved."""
    if not is_pretrained(cfg):
        return None
    source = cfg.model.source
    if _gguf(cfg) is None and hub.looks_like_hub_id(source) and not Path(source).exists():
        return source
    return str(weights_dir(cfg).resolve())


def as_built(cfg: RunConfig, spec: ModelSpec) -> ModelSpec:
    """`spec` as a pretrained run builds it: from the weights' own config.json, every field of it
    (a preset or config.json without weights: unchanged)."""
    directory = weights_dir(cfg) if is_pretrained(cfg) else None
    if directory is None:
        return spec
    return dataclasses.replace(spec, config=json.loads((directory / "config.json").read_text()))


def tokenizer_dir(cfg: RunConfig) -> Path:
    """Where the run's tokenizer is: the model's own directory; for random-init presets, the
    embedded SmolLM2 tokenizer's (its converted model directory where one is cached, else the
    tokenizer alone: its weights are not this run's)."""
    directory = weights_dir(cfg) if is_pretrained(cfg) else None
    return directory if directory is not None else gguf_tokenizer(default_gguf_path(), cfg.model.cache_dir)


def load_tokenizer(cfg: RunConfig, spec: ModelSpec):
    """The model's own tokenizer; for random-init presets, the embedded SmolLM2 tokenizer."""
    import transformers

    directory = tokenizer_dir(cfg)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise ConfigError(
            "model.source",
            f"no usable tokenizer in {str(directory)!r} ({e})".splitlines()[0],
            "the model directory needs its tokenizer files",
        ) from None
    if len(tokenizer) > spec.vocab_size:
        raise ConfigError(
            "model.source",
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {spec.vocab_size}",
            "use the tokenizer that belongs to the model (or a larger vocab_size)",
        )
    return tokenizer


def load_model(
    cfg: RunConfig,
    spec: ModelSpec,
    prec: Precision,
    device: torch.device,
    *,
    dims=None,
    mesh=None,
    stage: int = 0,
    allow_cpu: bool = False,
) -> nn.Module:
    """Build through run/build.py, then load pretrained weights or initialize randomly.

    stage: this rank's pipeline stage (dims.pp > 1): only its tensors are built and loaded.
    allow_cpu: qlora on bitsandbytes' CPU backend (tests only)."""
    model = build.build_model(spec, cfg, prec, dims=dims, mesh=mesh, stage=stage, allow_cpu=allow_cpu)
    if features.optimizer_offload.on_host(dims):  # FSDP2's CPUOffloadPolicy: parameters on the host, buffers not
        return build.buffers_to(_load_model(model, cfg, spec, torch.device("cpu")), device)
    return _load_model(model, cfg, spec, device)


def _load_model(model: nn.Module, cfg: RunConfig, spec: ModelSpec, device: torch.device) -> nn.Module:
    if not is_pretrained(cfg):
        return build.materialize(model, device)
    directory = weights_dir(cfg)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            "model.source",
            f"{str(directory)!r} has no .safetensors weights",
            "save the model with safe_serialization=True",
        )
    # rotary buffers and adapters; the weights are overwritten below, and quantized after that (qlora)
    build.materialize(model, device, quantize=False, loading=True)
    four_bit = qlora.is_4bit(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # PEFT wraps targeted linears: their weight is `<module>.base_layer.weight`; adapters are new.
    own = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
    source_name = {k: k.replace(".base_layer", "") for k in own}
    where = _tensor_files(files)

    def needs(src: str) -> list[str]:  # the file's tensors that make it: itself, or a mixture's per-expert ones
        return [src] if src in where else experts.sources(src, spec.model_type, where) or [src]

    missing = [
        k
        for k, src in source_name.items()
        if any(n not in where for n in needs(src)) and not (spec.tie_word_embeddings and src == "lm_head.weight")
    ]
    if missing:
        raise ConfigError(
            "model.source",
            f"weights are missing {len(missing)} tensors, e.g. {source_name[missing[0]]}",
            "the directory does not hold this architecture's weights",
        )
    # Copied from the memory-mapped file straight into the model's own storage, a tensor at a time:
    # nothing is allocated beside the model, so the load peak is the model itself (qlora: the
    # 16-bit weights stay on the host; only their 4-bit packing reaches the device).
    with torch.no_grad():
        for name, tensor in own.items():
            src_name = source_name[name]
            if src_name in where:
                _load_one(where[src_name], src_name, tensor)
            elif experts.sources(src_name, spec.model_type, where):
                _load_experts(src_name, tensor, where, spec.model_type)
    return qlora.quantize(model, device) if four_bit else model


def _load_experts(name: str, tensor: torch.Tensor, where: dict, model_type: str) -> None:
    try:
        experts.load(name, tensor, where, model_type)
    except KeyError as e:
        fix = "the directory does not hold this architecture's weights"
        raise ConfigError("model.source", f"weights are missing {e.args[0]}", fix) from None


class SafetensorsFile:
    """A .safetensors file read in place: its header, and each tensor as a zero-copy view of the
    memory-mapped bytes (safetensors' own torch loader allocates the whole file in the CPU
    allocator first). Format: 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the data."""

    DTYPES = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "BOOL": "bool",
    }

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries, self.data_start, self.size = safetensors_header(path)
            for v in self.entries.values():
                if v["dtype"] not in self.DTYPES:
                    raise ValueError(f"dtype {v['dtype']} is not one a model's weights are loaded from")
        except (OSError, ValueError) as e:  # truncated, not safetensors, or a header that lies
            raise ConfigError(
                "model.source",
                f"corrupt weights file {str(path)!r} ({e})".splitlines()[0],
                "re-download or re-convert the model",
            ) from None
        self._map = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        """A read-only view of the stored bytes (no copy; copy_ it where it belongs)."""
        import numpy as np

        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        entry = self.entries[name]
        begin, end = (self.data_start + o for o in entry["data_offsets"])
        dtype = getattr(torch, self.DTYPES[entry["dtype"]])
        raw = torch.from_numpy(self._map[begin:end])  # uint8, shares the mapping
        return raw.view(dtype).view(entry["shape"]) if end > begin else torch.empty(entry["shape"], dtype=dtype)


def _tensor_files(files: list[Path]) -> dict[str, SafetensorsFile]:
    """Which file holds each tensor (read from the headers only)."""
    where = {}
    for f in files:
        handle = SafetensorsFile(f)
        where.update(dict.fromkeys(handle.keys(), handle))
    return where


def _load_one(handle: SafetensorsFile, name: str, tensor: torch.Tensor) -> None:
    import warnings

    from torch.distributed.tensor import DTensor, distribute_tensor

    from trainplan import _torch_private as P

    if handle.shape(name) != tuple(tensor.shape):
        raise TrainplanError(
            f"model.source: {name} has shape {handle.shape(name)}, expected {tuple(tensor.shape)}; "
            "the weights belong to another model"
        )
    box = P.local_slice(tensor) if isinstance(tensor, DTensor) else None
    with warnings.catch_warnings(), P.untracked():  # read-only file bytes: no allocation of torch's
        warnings.simplefilter("ignore", UserWarning)
        src = handle.tensor(name)
        part = src[box] if box is not None else None  # an FSDP2 or tp shard: this rank's box of it
    if P.packed(tensor):  # a packed tp split: a box of each part, straight from the mapped bytes
        for piece_box, view in experts.local_pieces(tensor):
            with P.untracked():
                piece = src[piece_box]
            view.copy_(piece)
        return
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if part is not None and tuple(local.shape) == tuple(part.shape):
            local.copy_(part)  # straight from the mapped bytes: no collective, no whole copy
            return
        mesh = tensor.device_mesh  # every rank reads the whole file: each cuts its own (src_data_rank None)
        whole = src.to(mesh.device_type, tensor.dtype)
        shard = distribute_tensor(whole, mesh, tensor.placements, src_data_rank=None).to_local()
        tensor.to_local().copy_(shard)  # the local shard is in host memory under CPUOffloadPolicy
    else:
        tensor.copy_(src)
