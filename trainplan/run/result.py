"""The result of a run, always saved at its end in the ecosystem's own format, beside its tokenizer.

| mode        | what `<output_dir>/result/` holds                       | loads with                                   |
|-------------|---------------------------------------------------------|----------------------------------------------|
| lora, qlora | adapter_config.json + adapter_model.safetensors (PEFT)  | peft.PeftModel.from_pretrained(base, path)   |
| full        | config.json + model*.safetensors (sharded above 5 GB)   | AutoModelForCausalLM.from_pretrained(path)   |

Checkpoints (run/checkpoint/) resume a run; the result is what the run produced, for whoever uses
it next. Under FSDP every rank takes part in gathering the full tensors and the main rank writes; a
pipeline's stages each write their own tensors (under their whole-model names: full fine-tuning,
transformers' shard of the model; an adapter, a part the main rank merges).
The directory is written beside its final place and renamed, so a crash leaves no half result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from trainplan.features import lora
from trainplan.files import fsync_dir, write_atomic
from trainplan.run import dist

DIRNAME = "result"
MAX_SHARD_SIZE = "5GB"  # transformers' default shard size for save_pretrained


def _full_state_dict(model: nn.Module, *, trainable_only: bool, main: bool) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state on the CPU: a collective under FSDP, where rank 0 gets it.

    trainable_only (adapters): only the trainable tensors are gathered. get_model_state_dict's
    ignore_frozen_params drops the frozen base only after gathering all of it, so saving a LoRA
    adapter under FSDP all-gathered every base weight in full."""
    if trainable_only:
        state = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # a collective under FSDP
                if main:
                    state[name] = full.cpu()
        return state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(
    model: nn.Module,
    tokenizer,
    mode: str,
    out_dir: Path,
    env: dist.DistEnv,
    *,
    base_model: str | None,
    stage: tuple[int, int, int] | None = None,
) -> dict:
    """Write the result of a training run; returns what the run record keeps of it. `base_model`: where
    the base weights load from (run/weights.py `base_reference`), named in an adapter's config so that
    PEFT alone finds it; None for random weights. stage: (index, stages, place) of a pipeline's rank,
    its place among the stage's ranks (replicas and tp ranks): the first writes the stage."""
    base = getattr(model, "module", model)  # DDP's wrapper holds the model itself
    adapter = mode in lora.ADAPTER_MODES
    final = Path(out_dir) / DIRNAME
    tmp = final.with_name(f".{DIRNAME}.tmp")
    staged = stage is not None
    if staged:  # every stage writes its own tensors beside the main rank's: nothing is gathered
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        env.barrier()
        index, count, place = stage
        own = _write_stage(base, adapter, tmp, index, count, write=place == 0)  # gathered by every stage rank
        parts = [part for part in env.gather(own) if part]
        state = _full_state_dict(base, trainable_only=True, main=env.is_main) if adapter else {}  # the main rank's own
        if env.is_main and not adapter:
            _write_index(base, tmp, parts)
    else:
        state = _full_state_dict(base, trainable_only=adapter, main=env.is_main)
    if env.is_main:
        if not staged:
            shutil.rmtree(tmp, ignore_errors=True)
        if adapter:  # PEFT names and filters the adapter's keys itself
            for config in base.peft_config.values():  # built from a config on the meta device: no name yet
                config.base_model_name_or_path = base_model
            base.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if staged:  # PEFT wrote the main rank's stage: the adapter file is every stage's
                _merge_parts(tmp, parts)
        elif not staged:
            base.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(final.parent)
    env.barrier()
    files = sorted(p.name for p in final.iterdir()) if env.is_main else []
    return {
        "path": str(final),
        "format": "peft-adapter" if adapter else "transformers",
        "base_model": base_model,
        "loads_with": _loads_with(adapter, base_model),
        "files": files,
    }


def _write_stage(
    base: nn.Module, adapter: bool, tmp: Path, index: int, count: int, *, write: bool
) -> tuple[str, list[str], int] | None:
    """This pipeline stage's tensors, copied to the host a tensor at a time and written (`write`: the
    stage's first rank) to its own file in `tmp`: transformers' shard of the whole model (full), or its
    adapters under the names PEFT gives them in its file, which the main rank merges (PEFT names them
    from the modules it holds, so each stage names its own). Under FSDP2 or tp every rank of the stage
    gathers each tensor with the others. Returns (file name, tensor names, bytes), None where not written."""
    from safetensors.torch import save_file

    if adapter:
        from peft import get_peft_model_state_dict

        trainable = _full_state_dict(base, trainable_only=True, main=True)
        own = get_peft_model_state_dict(base, state_dict=trainable)
    else:
        own = base.state_dict()
    host = {}
    for k, v in own.items():  # a tensor at a time: one gathered tensor on the device at once
        whole = v.full_tensor() if hasattr(v, "full_tensor") else v
        if write:
            host[k] = whole.detach().contiguous().cpu()
    if not write:
        return None
    name = f"stage-{index:05d}.safetensors" if adapter else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    save_file(host, str(tmp / name), metadata={"format": "pt"})
    return name, sorted(host), sum(t.numel() * t.element_size() for t in host.values())


def _merge_parts(tmp: Path, parts: list[tuple[str, list[str], int]]) -> None:
    """PEFT's adapter file from every stage's part (the part files are removed)."""
    from safetensors.torch import load_file, save_file

    state: dict[str, torch.Tensor] = {}
    for name, _, _ in parts:
        state.update(load_file(str(tmp / name)))
        (tmp / name).unlink()
    save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})


def _write_index(base: nn.Module, tmp: Path, parts: list[tuple[str, list[str], int]]) -> None:
    """transformers' sharded layout over the stages' shards: model.safetensors.index.json, the config
    and the generation config, as save_pretrained writes them."""
    weight_map = {key: name for name, keys, _ in parts for key in keys}
    if len(weight_map) != sum(len(keys) for _, keys, _ in parts):  # internal: the cut gives a tensor one stage
        raise AssertionError("two pipeline stages hold the same tensor")
    index = {
        "metadata": {"total_size": sum(size for _, _, size in parts)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_atomic(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    base.config.save_pretrained(tmp)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(tmp)


def _loads_with(adapter: bool, base_model: str | None) -> str:
    if not adapter:
        return "transformers.AutoModelForCausalLM.from_pretrained(path)"
    if base_model is None:
        return "nothing: its base had random weights (model.init = random), never saved"
    return "peft.AutoPeftModelForCausalLM.from_pretrained(path) (the base named in adapter_config.json)"


def write_card(rec) -> None:
    """The result's model card (README.md), from the run record: the base, the data, the settings, the
    held-out metric before and after, and the training time. Written when the run has concluded."""
    result, cfg = rec.result, rec.config
    adapter = result["format"] == "peft-adapter"
    base = result.get("base_model")
    front = ["---"] + ([f"base_model: {json.dumps(base)}"] if base else [])
    front += [f"library_name: {'peft' if adapter else 'transformers'}", f"tags: [trainplan, {cfg['mode']}]", "---"]
    data, batch, model = rec.data, rec.batch, rec.model
    before, after = rec.eval_before or {}, rec.eval_after or {}
    lines = [
        *front,
        "",
        f"# {model['name']}: {cfg['mode']} fine-tuning with trainplan",
        "",
        "- **Base model:** "
        + (
            f"`{base}` (model.source = `{cfg['model']['source']}`)"
            if base
            else "randomly initialized (model.init = random, seed "
            f"{rec.seed}): never saved, so there is no base to load this result onto"
        ),
        f"- **Model:** {model['model_type']}, {model['params']:,} parameters, {model['layers']} layers",
        f"- **Data:** `{data['source']}` (fingerprint {data['fingerprint']}): {data['train_documents']} training "
        f"documents in {data['train_sequences']} sequences; held out: {data['eval_documents']} documents in "
        f"{data['eval_sequences']} sequences",
        f"- **Settings:** {cfg['precision']}, {len(rec.steps)} steps, micro-batch {batch['micro_batch_size']} x "
        f"accumulation {batch['grad_accum_steps']} = global batch {batch['global']} of {batch['seq_len']} tokens, "
        f"{cfg['optim']['name']} lr {cfg['optim']['lr']:g}, seed {rec.seed}"
        + (
            f"; LoRA r {cfg['lora']['r']}, alpha {cfg['lora']['alpha']:g}, dropout {cfg['lora']['dropout']:g} "
            f"on {', '.join(cfg['lora']['target_modules'])}"
            if adapter
            else ""
        ),
        f"- **Held-out metric** (mean next-token cross-entropy over {after.get('tokens', 0):,} held-out tokens): "
        f"loss {before.get('loss', float('nan')):.4f} before, {after.get('loss', float('nan')):.4f} after "
        f"(perplexity {before.get('perplexity', float('nan')):.2f} -> {after.get('perplexity', float('nan')):.2f})",
        f"- **Training time:** {rec.train_seconds or 0:.1f} s of training steps, {rec.wall_seconds or 0:.1f} s "
        f"in all, on {rec.hardware['devices']} (world size {rec.hardware['world_size']})",
        "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in rec.versions.items()),
    ]
    if rec.interrupted:
        lines.append(
            f"- **Stopped early:** interrupted by {rec.interrupted['signal']} after step {rec.interrupted['step']}"
        )
    elif rec.stopped:
        lines.append(f"- **Stopped early** by the stability guard at step {rec.stopped.get('step')}")
    lines += ["", "Load it:", "", "```python"]
    if adapter and base:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{result["path"]}")',
        ]
    elif not adapter:
        lines += [
            "from transformers import AutoModelForCausalLM",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{result["path"]}")',
        ]
    else:
        lines += ["# the adapter's base was never saved: it cannot be loaded"]
    lines += ["```", "", "Written by trainplan from the run's record.json.", ""]
    write_atomic(Path(result["path"]) / "README.md", "\n".join(lines))
