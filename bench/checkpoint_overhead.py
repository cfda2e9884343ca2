"""Seconds per checkpoint, and its share of training time at the default interval.

Run: .venv/bin/python bench/checkpoint_overhead.py   (figures in docs/benchmarks.md)
     .venv/bin/python bench/checkpoint_overhead.py --quick   (LoRA only, seq 64, two steps, one save: that it
     runs; tests/test_benches_run.py)

The embedded default (SmolLM2-135M), micro-batch 4 x seq 256 on this CPU, fp32: full fine-tuning
(weights + AdamW state: ~1.6 GB per checkpoint) and LoRA (adapters + their state). Medians of 3.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="LoRA only, seq 64, micro-batch 1, two steps, one save")
    args = ap.parse_args()
    seq, micro, steps, saves = (64, 1, 2, 1) if args.quick else (256, 4, 4, 3)
    warnings.filterwarnings("ignore")
    import transformers

    from trainplan import config as C
    from trainplan import resolve
    from trainplan.run import checkpoint, data, step, weights

    transformers.logging.set_verbosity_error()
    every = C.CheckpointConfig().every
    for mode in ("lora",) if args.quick else ("full", "lora"):
        sets = [f"mode={mode}", "precision=fp32", f"batch.seq_len={seq}", f"batch.micro_batch_size={micro}"]
        cfg = C.load(None, [*sets, "hardware.gpus=cpu"])
        r = resolve.resolve(cfg)
        tok = weights.load_tokenizer(cfg, r.spec)
        packed = data.pack(data.split_documents(data.load_documents("default"), 0.1)[0], tok, seq, r.spec.vocab_size)
        ids, labels = packed.ids, packed.labels
        model = weights.load_model(cfg, r.spec, r.precision, torch.device("cpu"))
        opt = step.build_optimizer(model, "adamw", "auto", 1e-5, 0.0, "cpu")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        step_times = []
        for i in range(steps):
            t0 = time.perf_counter()
            step.train_step(
                model,
                step.Update(opt, scheduler=sched),
                [{"input_ids": ids[i * micro : (i + 1) * micro], "labels": labels[i * micro : (i + 1) * micro]}],
                step.StepSettings(prec=r.precision, device_type="cpu"),
            )
            step_times.append(time.perf_counter() - t0)
        save_times, size = [], 0
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(saves):
                t0 = time.perf_counter()
                path = checkpoint.save(
                    Path(tmp),
                    step=k + 1,
                    model=model,
                    optimizer=opt,
                    scheduler=sched,
                    scaler=None,
                    state={"mode": mode, "step": k + 1},
                    keep_last=1,
                )
                save_times.append(time.perf_counter() - t0)
                size = sum(p.stat().st_size for p in path.iterdir())
        s, t = statistics.median(save_times), statistics.median(step_times[1:])
        share = s / (every * t + s)
        print(
            f"{mode:5s}: checkpoint {size / 2**20:8.1f} MiB in {s:6.2f} s; step {t:5.2f} s; "
            f"every {every} steps -> {100 * share:.2f}% of training time"
        )


if __name__ == "__main__":
    main()
