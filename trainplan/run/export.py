"""Using a run's model: find it (a run directory, its result/, or a checkpoint), rebuild it, and
write it out for others (`trainplan export`) or load it to generate (`trainplan generate`).

| source             | LoRA / QLoRA run                                        | full run                 |
|--------------------|---------------------------------------------------------|--------------------------|
| result/            | the PEFT adapter; its base is the run's model.source    | a transformers directory |
| checkpoints/step-N | the base as the run loaded it, the adapter tensors in   | every weight loaded      |

A checkpoint holds the trainable tensors only (the adapter, for LoRA) and the run's config; it is
used only when its model fingerprint is the one that config rebuilds, so a base model changed
since the run is refused, never silently merged with the wrong weights. Written directories are
safetensors only, built in a temporary directory beside the target and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.features import lora
from trainplan.features.lora.engine import apply_mode
from trainplan.files import atomic_dir, read_json, refuse_special, safetensors_header
from trainplan.resolve import resolve
from trainplan.run import checkpoint, converter, generate, weights
from trainplan.run.checkpoint.manager import model_fingerprint
from trainplan.run.result import DIRNAME
from trainplan.spec.precision import PRECISIONS

ADAPTER_MODES = lora.ADAPTER_MODES
WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")  # pickled weights: never copied


@dataclass(frozen=True)
class Source:
    """A run's model, found on disk."""

    kind: str  # "result" | "checkpoint"
    path: Path  # the result directory or the checkpoint directory
    mode: str  # lora | qlora | full
    config: dict | None  # the run's config (record.json, or the checkpoint's state.json); None if not found

    @property
    def adapter(self) -> bool:
        return self.mode in ADAPTER_MODES

    @property
    def base_source(self) -> str | None:
        return self.config["model"]["source"] if self.config else None


def locate(path: Path, field: str) -> Source:
    """What `path` holds: a checkpoint (step-N/), a run directory (with result/), or a result."""
    path = Path(path)
    refuse_special(path, field, "give a run directory, its result/ or a checkpoint")
    if (path / "manifest.json").is_file():
        reason = checkpoint.validate(path)
        if reason is not None:
            raise ConfigError(
                field, f"checkpoint {str(path)!r} is not usable: {reason}", "give another (an older) checkpoint"
            )
        state = json.loads((path / "state.json").read_text())  # validate() read and checked it
        if "config" not in state:
            raise ConfigError(
                field,
                f"checkpoint {str(path)!r} does not hold its run's config",
                "give a checkpoint `trainplan train` wrote",
            )
        return Source(kind="checkpoint", path=path, mode=state["mode"], config=state["config"])
    if (path / DIRNAME).is_dir():
        path = path / DIRNAME
    elif path.is_dir() and any(path.glob(f"{checkpoint.format.PREFIX}*")):  # a checkpoints/ directory
        newest, _ = checkpoint.latest_valid(path)
        if newest is None:
            raise ConfigError(field, f"{str(path)!r} holds no valid checkpoint", "give a run's result/ instead")
        return locate(newest, field)
    if (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        record = path.parent / "record.json"
        config = record_config(record, field) if record.is_file() else None
        adapter = (path / "adapter_config.json").is_file()
        mode = config["mode"] if config and adapter else ("lora" if adapter else "full")
        return Source(kind="result", path=path, mode=mode, config=config)
    if not path.exists():
        raise ConfigError(
            field, f"no such directory {str(path)!r}", "give a run directory, its result/ or a checkpoint"
        )
    hint = " (its checkpoints are under checkpoints/step-N)" if (path / "checkpoints").is_dir() else ""
    raise ConfigError(
        field,
        f"{str(path)!r} is neither a run directory, a result nor a checkpoint{hint}",
        "give a run's --output-dir, its result/ directory, or a checkpoints/step-NNNNNNNN directory",
    )


def record_config(record: Path, field: str) -> dict:
    """The config a run's record.json holds, checked: an object whose "config" has the run's mode."""
    doc = read_json(record, field)
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict) or config.get("mode") not in C.MODES:
        raise ConfigError(
            field,
            f"{str(record)!r} is not a trainplan run record (no config with its mode)",
            "give a run directory that `trainplan train` wrote, or its result/ alone without the record",
        )
    return config


def rebuild(src: Source, device: torch.device, field: str) -> tuple[nn.Module, object]:
    """The model of a checkpoint, from its own config: the base loaded as the run loaded it, a
    PEFT adapter on it (LoRA), the checkpoint's trainable tensors copied in. (model, tokenizer)"""
    assert src.kind == "checkpoint"
    state = json.loads((src.path / "state.json").read_text())
    cfg = C.from_dict(state["config"])
    r = resolve(cfg)
    pretrained = weights.is_pretrained(cfg)
    if not pretrained and src.adapter:
        raise ConfigError(
            field,
            f"{src.path.name} is an adapter on randomly initialized weights (model.init = random), which no file holds",
            "export a run that started from a pretrained model",
        )
    spec = weights.as_built(cfg, r.spec)
    found = model_fingerprint(dataclasses.replace(r, spec=spec))
    if found != state.get("model_fingerprint"):
        raise ConfigError(
            field,
            f"{src.path.name} belongs to another model: its run's model.source {cfg.model.source!r} now describes a "
            f"different one (fingerprint {found} vs the checkpoint's {state.get('model_fingerprint')})",
            "export with the model files the run trained, unchanged",
        )
    inference = dataclasses.replace(cfg, mode="inference", precision="fp32")
    model = weights.load_model(inference, spec, PRECISIONS["fp32"], device)
    # the run's trainable tensors, by the names the run gave them: an adapter on the base, or every weight
    model = apply_mode(model, dataclasses.replace(cfg, mode="lora" if src.adapter else "full"))
    _load_trainable(src.path, model, state.get("format", "safetensors"), field)
    return model.requires_grad_(False).eval(), weights.load_tokenizer(cfg, spec)


def _load_trainable(path: Path, model: nn.Module, fmt: str, field: str) -> None:
    """Copy the checkpoint's trainable tensors into `model`, refusing any that do not fit."""
    own = checkpoint.trainable_state(model)
    if fmt == "dcp":  # per-rank shards: read the model's pieces, in this process's layout
        import torch.distributed.checkpoint as dcp

        tensors = {k: torch.empty_like(v) for k, v in own.items()}
        try:
            dcp.load({"model": tensors}, checkpoint_id=str(path / "dcp"), no_dist=True)
        except Exception as e:  # DCP raises CheckpointException with per-rank tracebacks
            first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
            raise ConfigError(
                field, f"{path.name} does not fit its model ({first})", "give another checkpoint"
            ) from None
    else:
        from safetensors.torch import load_file

        _checked_weights(path / "model.safetensors", field)
        tensors = load_file(str(path / "model.safetensors"), device="cpu")
    wrong = sorted(set(tensors) ^ set(own)) or [k for k in own if tensors[k].shape != own[k].shape]
    if wrong:
        raise ConfigError(
            field, f"{path.name} holds other tensors than its model trains (e.g. {wrong[0]})", "give another checkpoint"
        )
    live = model.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            live[name].copy_(t)


def load_trained(src: Source, device: torch.device, *, field: str, base: str | None = None):
    """The run's trained model for inference: (model, tokenizer). LoRA: a PeftModel on the base
    (`base`, else the run's recorded model.source)."""
    if src.kind == "checkpoint":
        return rebuild(src, device, field)
    if not src.adapter:
        loaded = generate.load(str(src.path), device, field=field)
        return loaded.model, loaded.tokenizer
    source = base or src.base_source
    if source is None:
        raise ConfigError(
            "--base",
            f"the adapter in {str(src.path)!r} has no run record beside it naming its base model",
            "give the base model with --base MODEL",
        )
    if base is None and src.config["model"]["init"] == "random":
        raise ConfigError(
            "--base",
            "the run trained its adapter on randomly initialized weights (model.init = random), which no file holds",
            "give the base model with --base MODEL",
        )
    import transformers

    loaded = generate.load(source, device, field="--base" if base else "model.source (the run's base)", tokenizer=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src.path))  # the run's own, saved beside it
    return generate.attach_adapter(loaded.model, src.path, field=field), tokenizer


def stored_dtype(directory: Path) -> torch.dtype:
    """The dtype most of a model directory's weights are stored in."""
    counts: dict[str, int] = {}
    for f in sorted(directory.glob("*.safetensors")):
        handle = weights.SafetensorsFile(f)
        for name in handle.keys():
            dtype = handle.entries[name]["dtype"]
            counts[dtype] = counts.get(dtype, 0) + 1
    name = max(counts, key=counts.get) if counts else "F32"
    return getattr(torch, weights.SafetensorsFile.DTYPES[name])


def refuse_existing(out: Path, *, force: bool, field: str = "-o") -> None:
    """An output that exists is replaced only with --force, and never when it is a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(field, f"{str(out)!r} is a file", "give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            field, f"{str(out)!r} exists and is not empty", "give a new directory, or --force to replace it"
        )


def refuse_onto_source(out: Path, src: Source, field: str = "-o") -> None:
    """An export never replaces what it reads, --force or not: not the checkpoint or result itself,
    not a directory holding it (the run's own), not a directory inside it."""
    o, s = Path(out).resolve(), src.path.resolve()
    if o == s or o in s.parents or s in o.parents:
        raise ConfigError(
            field,
            f"{str(out)!r} is, holds or lies inside the {src.kind} being exported ({str(src.path)!r})",
            "give a directory outside the run",
        )


def _copy_result(result: Path, tmp: Path, field: str) -> None:
    """A result directory as it is, without pickled weights."""
    files = [f for f in sorted(result.iterdir()) if f.is_file()]
    if not any(f.suffix == ".safetensors" for f in files):
        raise ConfigError(field, f"{str(result)!r} holds no .safetensors weights", "safetensors only: re-save it")
    for f in files:
        if f.suffix == ".safetensors":
            _checked_weights(f, field)
    for f in files:
        if f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(f, tmp / f.name)


def _checked_weights(f: Path, field: str) -> None:
    """A weights file an export copies or loads passes the checked header reader: a header that parses, known
    dtypes, and every tensor's bytes inside the file and equal to its shape's. Random bytes, a cut file or
    a header that lies are refused before anything is written."""
    try:
        safetensors_header(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            field,
            f"{str(f)!r} is not a safetensors file trainplan can stand behind: {e}",
            "export from one of the run's checkpoints, or train the run again",
        ) from None


def export(src: Source, out: Path, *, merge: bool, base: str | None, force: bool, field: str) -> dict:
    """Write the run's model to `out`: merged into a transformers directory (`merge`, LoRA), the
    PEFT adapter (LoRA), or the transformers directory (full). Returns what was written."""
    device = torch.device("cpu")  # a merge is a few matrix products per layer; the host holds the model
    fmt = "transformers" if merge or not src.adapter else "peft-adapter"
    refuse_existing(out, force=force)
    with atomic_dir(out) as tmp:
        if src.kind == "result" and not (merge and src.adapter):  # already in the format asked for
            _copy_result(src.path, tmp, field)
        else:
            model, tokenizer = load_trained(src, device, field=field, base=base)
            if merge and src.adapter:  # merged in fp32, stored as the base's weights are
                base_cfg = C.load(None, [], {"model.source": base}) if base else C.from_dict(src.config)
                base_dir = weights.weights_dir(base_cfg)
                model = model.merge_and_unload().to(stored_dtype(base_dir))
            elif not src.adapter:  # a full run's checkpoint: stored as the run's result would be
                model = model.to(converter.dtypes(PRECISIONS[src.config["precision"]]).param)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir())
    return {"path": str(out), "format": fmt, "files": files, "source": str(src.path), "mode": src.mode}
