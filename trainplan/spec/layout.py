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

from trainplan.errors import ConfigError, in_its_words, nearest

VERSION = 2  # bump when what a layout lists changes (2: whether transformers runs SDPA for it)


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
        entry = json.loads(path.read_text())
        layout, sdpa = entry["layout"], entry["sdpa"]
        if not isinstance(layout, list) or not isinstance(sdpa, bool):
            raise TypeError(layout)
    except (OSError, ValueError, KeyError, TypeError):  # absent or damaged: list it again
        layout, sdpa = meta_layout(spec.config), transformers_supports_sdpa(spec.model_type)
        _write(path, {"layout": layout, "sdpa": sdpa, "key": key})
    _SDPA[spec.model_type] = sdpa  # a warm plan asks the cache, not transformers (which imports torch)
    return dataclasses.replace(spec, layout=tuple((name, tuple(shape)) for name, shape in layout))


def meta_layout(config: dict) -> list:
    """[[name, shape], ...] of the real causal LM built on the meta device (a tied head once)."""
    import torch
    import transformers

    causal_lm_type(config["model_type"])
    try:
        hf = transformers.CONFIG_MAPPING[config["model_type"]](**config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf)
    except Exception as e:  # transformers' own code refusing this config: the config's fault, in its words
        raise ConfigError(
            "model.source",
            f"transformers {transformers.__version__} cannot build a {config['model_type']} model from this config "
            f"({in_its_words(e, 200)})",
            "fix the config.json, or use the one the model was published with",
        ) from None
    return [[name, list(p.shape)] for name, p in model.named_parameters()]


_SDPA: dict[str, bool] = {}  # model_type -> its model class's `_supports_sdpa`, as the layout cache holds it


def transformers_supports_sdpa(model_type: str) -> bool:
    """What the architecture's transformers model class declares (`_supports_sdpa`: gpt-oss's sinks run eager)."""
    if model_type in _SDPA:
        return _SDPA[model_type]
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    _SDPA[model_type] = bool(getattr(getattr(transformers, name, None) if name else None, "_supports_sdpa", True))
    return _SDPA[model_type]


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
