"""A derived architecture's parameter layout, as its real transformers module lists it.

Built on the meta device from the model's own config.json (names and shapes do not depend on the
attention implementation), and cached per config under model.cache_dir (or $TRAINPLAN_CACHE), beside
the derived terms: what LoRA's targets resolve against and a derived spec's tensors are read from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from trainplan.errors import ConfigError, nearest

VERSION = 1  # bump when what a layout lists changes


def cache_dir(base: str) -> Path:
    """Under model.cache_dir (the GGUF conversions' cache too), or $TRAINPLAN_CACHE."""
    return Path(os.environ.get("TRAINPLAN_CACHE") or base).expanduser() / "derived"


def with_layout(spec, cache_base: str):
    """A derived spec with its layout filled in (read from the cache, or listed now and cached).
    Any other spec, or one that has its layout already, as it is."""
    if not spec.derived or spec.layout:
        return spec
    key = {"version": VERSION, "config": spec.config}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_dir(cache_base) / f"layout-{spec.model_type}-{digest}.json"
    try:
        layout = json.loads(path.read_text())["layout"]
        if not isinstance(layout, list):
            raise TypeError(layout)
    except (OSError, ValueError, KeyError, TypeError):  # absent or damaged: list it again
        layout = meta_layout(spec.config)
        _write(path, {"layout": layout, "key": key})
    return dataclasses.replace(spec, layout=tuple((name, tuple(shape)) for name, shape in layout))


def meta_layout(config: dict) -> list:
    """[[name, shape], ...] of the real causal LM built on the meta device (a tied head once)."""
    import torch
    import transformers

    causal_lm_type(config["model_type"])
    hf = transformers.CONFIG_MAPPING[config["model_type"]](**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    return [[name, list(p.shape)] for name, p in model.named_parameters()]


def _write(path: Path, entry: dict) -> None:
    from trainplan.files import write_atomic

    try:
        write_atomic(path, json.dumps(entry))
    except OSError:
        pass  # an unwritable cache costs the next plan a listing, nothing else


def causal_lm_type(model_type: str) -> None:
    """Refuse a model_type transformers does not know, or knows as something other than a decoder-only
    causal LM (an encoder such as BERT, an encoder-decoder such as T5), naming what it knows."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        raise ConfigError(
            "model.source",
            f"model_type {model_type[:60]!r} is not an architecture transformers {transformers.__version__} knows",
            nearest(model_type, known),
        )
    if model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ConfigError(
            "model.source",
            f"model_type {model_type!r} is not a decoder-only causal LM (an encoder or encoder-decoder model)",
            "trainplan plans and trains decoder-only models such as llama, qwen2, mistral, gemma2 or gpt2",
        )
