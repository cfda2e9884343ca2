"""A real bitsandbytes NF4 LoRA step (its CPU backend), measured per phase and component with the
storage tracker, beside the analytic plan of the same settings (planned for a CUDA device).

Run: .venv/bin/python bench/qlora_step.py [--hidden 512 --intermediate 1376 --precision bf16]
     .venv/bin/python bench/qlora_step.py --quick   (hidden 128, seq 32: that it runs)
Recorded in docs/memory-model.md ("QLoRA: the plan against a real bitsandbytes step").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="hidden 128, intermediate 344, seq 32, micro-batch 1")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.seq, args.micro_batch = 128, 344, 32, 1

    import torch

    from trainplan import _torch_private as P
    from trainplan import config as C
    from trainplan.plan import analytic
    from trainplan.plan import tracestep as T
    from trainplan.resolve import resolve
    from trainplan.run import build, measure, step

    h, vocab = args.hidden, 512
    config = {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": 2,
        "num_attention_heads": h // 64,
        "num_key_value_heads": h // 64,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
    }
    source = Path(tempfile.mkdtemp()) / "config.json"
    source.write_text(json.dumps(config))
    targets = '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]'
    cfg = C.load(
        None,
        [
            f"model.source={source}",
            "model.init=random",
            "mode=qlora",
            "hardware.gpus=H100-80GB",
            f"precision={args.precision}",
            f"batch.seq_len={args.seq}",
            f"batch.micro_batch_size={args.micro_batch}",
            "lora.dropout=0",
            f"lora.target_modules={targets}",
        ],
    )
    r = resolve(cfg)
    torch.manual_seed(0)
    model = build.build_model(r.spec, cfg, r.precision, allow_cpu=True)
    build.materialize(model, "cpu")
    optimizer = step.build_optimizer(model, "adamw", "auto", 1e-4, 0.0, "cpu")
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq))
    micro_batches = [{"input_ids": ids, "labels": ids.clone()}]
    tracker = P.StorageTracker()
    tracker.track(model, optimizer, [ids, micro_batches[0]["labels"]])
    peaks = T.PhasePeaks(tracker)
    tokens = args.micro_batch * (args.seq - 1)
    T.two_steps(r, model, optimizer, micro_batches, tokens, peaks, contextlib.nullcontext())
    adapter = sum(measure.local_nbytes(p) for p in model.parameters() if p.requires_grad)
    states = sum(
        measure.local_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    planned = analytic.plan(cfg).devices[0]
    print("| phase | component | measured B | planned B |")
    print("|---|---|---:|---:|")
    for phase, raw in peaks.phases.items():
        got = measure.to_components(raw, adapter_params=adapter, states=states, lora=True, phase=phase)
        want = planned.phases[phase]
        for c in sorted(set(got) | {k for k, v in want.items() if v}):
            print(f"| {phase} | {c} | {got.get(c, 0):,} | {want.get(c, 0):,} |")
        m, p = sum(got.values()), sum(want.values())
        print(f"| {phase} | **total** | {m:,} | {p:,} ({(p - m) / m * 100:+.1f} %) |")


if __name__ == "__main__":
    main()
