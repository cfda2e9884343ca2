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

import shutil
from pathlib import Path

import torch
from torch import nn

from trainplan.features import lora
from trainplan.files import fsync_dir
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


def save(model: nn.Module, tokenizer, mode: str, out_dir: Path, env: dist.DistEnv) -> dict:
    """Write the result of a training run; returns what the run record keeps of it."""
    base = getattr(model, "module", model)  # DDP's wrapper holds the model itself
    adapter = mode in lora.ADAPTER_MODES
    state = _full_state_dict(base, trainable_only=adapter, main=env.is_main)
    final = Path(out_dir) / DIRNAME
    if env.is_main:
        tmp = final.with_name(f".{DIRNAME}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if adapter:  # PEFT names and filters the adapter's keys itself
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
        "loads_with": "peft.PeftModel.from_pretrained(base_model, path)"
        if adapter
        else "transformers.AutoModelForCausalLM.from_pretrained(path)",
        "files": files,
    }
