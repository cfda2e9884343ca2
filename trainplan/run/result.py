"""The result of a run, always saved at its end in the ecosystem's own format, beside its tokenizer.

| mode        | what `<output_dir>/result/` holds                       | loads with                                   |
|-------------|---------------------------------------------------------|----------------------------------------------|
| lora, qlora | adapter_config.json + adapter_model.safetensors (PEFT)  | peft.PeftModel.from_pretrained(base, path)   |
| full        | config.json + model*.safetensors (sharded above 5 GB)   | AutoModelForCausalLM.from_pretrained(path)   |

Checkpoints (run/checkpoint/) resume a run; the result is what the run produced, for whoever uses
it next. Under FSDP every rank takes part in gathering the full tensors; the main rank writes.
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


def save(model: nn.Module, tokenizer, mode: str, out_dir: Path, env: dist.DistEnv, *, base_model: str | None) -> dict:
    """Write the result of a training run; returns what the run record keeps of it. `base_model`: where
    the base weights load from (run/weights.py `base_reference`), named in an adapter's config so that
    PEFT alone finds it; None for random weights."""
    base = getattr(model, "module", model)  # DDP's wrapper holds the model itself
    adapter = mode in lora.ADAPTER_MODES
    state = _full_state_dict(base, trainable_only=adapter, main=env.is_main)
    final = Path(out_dir) / DIRNAME
    if env.is_main:
        tmp = final.with_name(f".{DIRNAME}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if adapter:  # PEFT names and filters the adapter's keys itself
            for config in base.peft_config.values():  # built from a config on the meta device: no name yet
                config.base_model_name_or_path = base_model
            base.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        else:
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
