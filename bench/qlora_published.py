"""QLoRA and LoRA plans against LitGPT's published Llama-2 measurements (micro-batch 1).

Run: .venv/bin/python bench/qlora_published.py   (--quick: the same, plans only and quick already)
Recorded in docs/memory-model.md ("QLoRA against published measurements").

The points: LitGPT's tutorials/resource-tables.md (commit 0cc02afa, 2023-10-27), "Finetuning with
LoRA on 1 GPU": one A100-SXM4-40GB, torch 2.1.0+cu121, bitsandbytes 0.41.1, `finetune/lora.py` with
`--precision bf16-true`, LoRA r=8 on query and value only, micro-batch 1, no activation
checkpointing, Alpaca with its longest sample (1,304 Llama-2 tokens) forced into the first step, the
head and its loss chunked by 128 tokens; paged AdamW (32-bit states) for the 4-bit rows, AdamW for
the 16-bit ones. Each figure is `torch.cuda.max_memory_allocated() / 1e9`.

Each row is planned here with the same settings (this repo's engine: HF's module layout, bitsandbytes
0.50.2). One term differs between the two stacks: bitsandbytes 0.41's `MatMul4Bit.forward` kept its
input for backward (`ctx.tensors = (A, B)`) whenever a gradient was needed, though the frozen 4-bit
weight needs none; the pinned 0.50.2 keeps only the packed weight (`ctx.tensors = (None, B)`,
bitsandbytes/autograd/_functions.py). The "+ the stack's terms" column adds, per layer, the inputs
of the 4-bit linears that nothing else saves: the attention's normed input (shared by q, k, v), the
attention output (o_proj's input), the MLP's normed input (shared by gate and up) and down_proj's
input, each 1,304 tokens x width x 2 bytes (bf16); and for "bnb.nf4" (no double quantization, which
the engine always uses) the fp32 absmax per 64 weights in place of the nested 8-bit one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SEQ = 1304  # Alpaca's longest Llama-2 sample: LitGPT forces it into the first step
# Llama-2's configs (meta-llama/Llama-2-{7b,13b}-hf config.json): untied head, 32k vocabulary, MHA
LLAMA2 = {
    "7B": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32},
    "13B": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40},
}
# (size, mode, LitGPT's quantization, published GB): resource-tables.md, micro-batch 1 rows
PUBLISHED = [
    ("7B", "lora", "None", 21.30),
    ("7B", "qlora", "bnb.nf4", 14.14),
    ("7B", "qlora", "bnb.nf4-dq", 13.84),
    ("13B", "lora", "None", 38.12),
    ("13B", "qlora", "bnb.nf4", 23.14),
    ("13B", "qlora", "bnb.nf4-dq", 22.55),
]


def config_file(size: str, root: Path) -> Path:
    dims = LLAMA2[size]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **dims,
        "num_key_value_heads": dims["num_attention_heads"],
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    path = root / f"llama-2-{size}.json"
    path.write_text(json.dumps(config))
    return path


def saved_inputs_041(size: str) -> int:
    """The 4-bit linears' inputs bitsandbytes 0.41 kept for backward and 0.50 does not (bytes)."""
    d = LLAMA2[size]
    per_layer = SEQ * (3 * d["hidden_size"] + d["intermediate_size"]) * 2
    return per_layer * d["num_hidden_layers"]


def absmax_without_double_quant(size: str) -> int:
    """What "bnb.nf4" stores beyond the planned "bnb.nf4-dq": an fp32 absmax per 64 weights instead of
    an 8-bit one plus an fp32 constant per 256 blocks (the engine always double-quantizes)."""
    d = LLAMA2[size]
    h, i = d["hidden_size"], d["intermediate_size"]
    weights = (4 * h * h + 3 * h * i) * d["num_hidden_layers"]  # q, k, v, o; gate, up, down
    return round(weights / 64 * (4 - 1 - 4 / 256))


def rows() -> list[dict]:
    """Each published point beside its plan (bytes) and the two stacks' differing terms (bytes)."""
    from trainplan import config as C
    from trainplan.plan import analytic

    root = Path(tempfile.mkdtemp())
    out = []
    for size, mode, quant, published in PUBLISHED:
        settings = [
            f"model.source={config_file(size, root)}",
            f"mode={mode}",
            "precision=bf16",
            f"batch.seq_len={SEQ}",
            "batch.micro_batch_size=1",
            "memory.activation_checkpointing=false",
            "memory.attention=sdpa",
            "lora.r=8",
            "lora.alpha=16",
            "lora.dropout=0.05",
            'lora.target_modules=["q_proj", "v_proj"]',
            "hardware.gpus=A100-40GB",
        ]
        stack = saved_inputs_041(size) if mode == "qlora" else 0
        stack += absmax_without_double_quant(size) if quant == "bnb.nf4" else 0
        peak = analytic.plan(C.load(None, settings)).devices[0].peak_allocated
        out.append(
            {"size": size, "mode": mode, "quant": quant, "published": published * 1e9, "plan": peak, "stack": stack}
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same rows: plans only, a few seconds already")
    ap.parse_args()
    print("| model | quantization | published GB | plan GB | plan vs published | + the stack's terms | vs published |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows():
        published, plan, both = r["published"], r["plan"], r["plan"] + r["stack"]
        cells = [
            f"Llama-2 {r['size']}",
            r["quant"],
            f"{published / 1e9:.2f}",
            f"{plan / 1e9:.2f}",
            f"{(plan - published) / published:+.1%}",
            f"{both / 1e9:.2f}" if r["stack"] else "-",
            f"{(both - published) / published:+.1%}" if r["stack"] else "-",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
