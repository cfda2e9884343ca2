"""Text from a model: the engine's own loader, an optional PEFT adapter, greedy (or sampled) decoding.

`trainplan generate` prints completions with it; accept records before/after samples of held-out
prompts with it (`run_samples`). Greedy decoding is deterministic: the same model and prompt give
the same tokens every time, so a sample can be compared across runs and checked in a test.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainplan import config as C
from trainplan.errors import ConfigError, TrainplanError
from trainplan.run import data, weights
from trainplan.spec.model import load_model_spec
from trainplan.spec.precision import PRECISIONS

SAMPLE_PROMPTS = 3  # accept: held-out documents sampled
SAMPLE_PROMPT_TOKENS = 16  # the beginning of a plain-text document that serves as its prompt
SAMPLE_NEW_TOKENS = 24


@dataclass(frozen=True)
class Loaded:
    model: nn.Module  # eval mode, on its device
    tokenizer: object  # None where the caller has its own


def device_default() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _precision(device: torch.device) -> str:
    """fp32 on the CPU (exact, and what the tests compare against); 16-bit weights on a GPU."""
    if device.type != "cuda":
        return "fp32"
    return "amp-bf16" if torch.cuda.is_bf16_supported() else "amp-fp16"


def load(
    source: str,
    device: torch.device,
    *,
    field: str = "model.source",
    tokenizer: bool = True,
) -> Loaded:
    """Load `source` (anything model.source accepts that carries weights: "default", an HF
    directory or Hub id in the cache, a .gguf, a full run's result/) through the engine's loader,
    for inference. Errors name `field` (the flag the user gave) instead of model.source.
    tokenizer=False: the caller has the tokenizer (Loaded.tokenizer is None)."""
    cfg = C.load(None, [], {"model.source": source, "mode": "inference", "precision": _precision(device)})
    try:
        spec = load_model_spec(source)
        try:
            weights.is_pretrained(cfg)
        except ConfigError:  # a preset, a config.json, a Hub id not downloaded: an architecture without weights
            raise ConfigError(
                "model.source",
                f"{source!r} carries no weights to generate with",
                'give a model directory, a Hub id in the local cache (`hf download ORG/NAME`), a .gguf or "default"',
            ) from None
        spec = weights.as_built(cfg, spec)
        tok = weights.load_tokenizer(cfg, spec) if tokenizer else None
        model = weights.load_model(cfg, spec, PRECISIONS[cfg.precision], device)
    except TrainplanError as e:
        if field == "model.source":
            raise
        raise TrainplanError(str(e).replace("model.source:", f"{field}:", 1)) from None
    return Loaded(model=model.eval(), tokenizer=tok)


def adapter_file(adapter_dir: Path, field: str) -> Path:
    """The adapter's weights file; refuses a directory that holds no PEFT adapter in safetensors."""
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ConfigError(
            field,
            f"{str(adapter_dir)!r} holds no PEFT adapter (no adapter_config.json)",
            "give the result/ directory of a LoRA run, or its `trainplan export` without --merge",
        )
    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        raise ConfigError(
            field, f"{str(adapter_dir)!r} has no adapter_model.safetensors", "safetensors only: re-save the adapter"
        )
    return path


def _shapes(path: Path, field: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # truncated, or not safetensors
        raise ConfigError(field, f"corrupt adapter file {str(path)!r} ({e})".splitlines()[0], "re-save it") from None


def attach_adapter(model: nn.Module, adapter_dir: Path, *, field: str = "--adapter") -> nn.Module:
    """`model` with the PEFT adapter in `adapter_dir` applied (a PeftModel; its base is `model`).

    Refuses an adapter that does not fit the model, tensor for tensor: PEFT itself only warns
    about adapter tensors that find no module (an adapter for a deeper model would load half)."""
    import peft

    stored = _shapes(adapter_file(adapter_dir, field), field)
    fix = "give the adapter trained on this base model, or that base model"
    try:
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            tuned = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:  # missing target modules, size mismatch
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise ConfigError(field, f"{str(adapter_dir)!r} does not fit the model ({first[:200]})", fix) from None
    live = {
        re.sub(r"\.(lora_\w+)\.default\b", r".\1", k): tuple(v.shape)
        for k, v in tuned.state_dict().items()
        if "lora_" in k
    }
    unplaced = [k for k in stored if live.get(k) != stored[k]]
    if unplaced or len(live) != len(stored):
        what = f"e.g. {unplaced[0]}" if unplaced else f"{len(live)} adapter tensors in the model vs {len(stored)}"
        raise ConfigError(field, f"{str(adapter_dir)!r} does not fit the model ({what})", fix)
    return tuned.eval()


def prompt_ids(tokenizer, text: str, *, chat_template: bool = True) -> list[int]:
    """The prompt as token ids: one user turn in the model's chat template, where it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tokenizer(text)["input_ids"])


def complete(
    model: nn.Module,
    tokenizer,
    ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    streamer=None,
) -> list[int]:
    """The new token ids after `ids`: greedy at temperature 0 (deterministic), else sampled from
    the temperature-scaled distribution (no top-k / top-p cut), seeded. Stops at end-of-sequence."""
    import transformers

    if not ids:
        raise TrainplanError("prompt: encodes to no tokens; give a non-empty prompt")
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    eos = tokenizer.eos_token_id
    sampled = temperature > 0
    gen = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampled,
        **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if sampled else {}),
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen, streamer=streamer)
    model.train(was_training)
    return out[0, len(ids) :].tolist()


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---- accept's before / after samples ----------------------------------------------------------


def held_out_prompts(cfg: C.RunConfig, tokenizer, n: int = SAMPLE_PROMPTS) -> list[list[int]]:
    """The prompts of the first `n` held-out documents, as the run tokenized them: a plain
    document's first SAMPLE_PROMPT_TOKENS tokens; a prompt/completion or chat document up to
    where its loss starts (its prompt)."""
    _, held_out = data.load(cfg.data, cache=data.cache_dir(cfg.model.cache_dir))  # as the run split them
    prompts = []
    for doc in held_out[:n]:
        ids, labels = data.tokenize(doc, tokenizer)
        start = next((i for i, label in enumerate(labels) if label != data.IGNORE_INDEX), len(ids))
        prompts.append(ids[: start or SAMPLE_PROMPT_TOKENS])
    return [p for p in prompts if p]


def run_samples(
    run_config: dict, result: dict | None, *, device: torch.device | None = None, new_tokens: int = SAMPLE_NEW_TOKENS
) -> list[dict]:
    """Greedy completions of held-out prompts by the run's base model (before) and its result
    (after): [{prompt, before, after}]. Empty for a run without a result (inference) or without a
    pretrained base to compare with (model.init = "random"). `run_config`: the record's config."""
    cfg = C.from_dict(run_config)
    if cfg.mode == "inference" or not result or not weights.is_pretrained(cfg):
        return []
    device = device or device_default()
    path = Path(result["path"])
    base = load(cfg.model.source, device)
    tok = base.tokenizer
    prompts = held_out_prompts(cfg, tok)

    def texts(model) -> list[str]:
        return [decode(tok, complete(model, tok, p, max_new_tokens=new_tokens)) for p in prompts]

    if result["format"] == "peft-adapter":  # one model: the adapter switched off gives the base
        tuned = attach_adapter(base.model, path, field="result")
        after = texts(tuned)
        with tuned.disable_adapter():
            before = texts(tuned)
    else:
        before = texts(base.model)
        base = None  # the base leaves memory before the trained model loads
        after = texts(load(str(path), device, field="result").model)
    return [{"prompt": decode(tok, p), "before": b, "after": a} for p, b, a in zip(prompts, before, after, strict=True)]
