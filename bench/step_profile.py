"""Where a LoRA step's time goes on this CPU: torch.profiler's top ops for trainplan's step (eager and
train.compile) and for the step Hugging Face Trainer + PEFT runs (transformers' loss, its AdamW).

Run: .venv/bin/python bench/step_profile.py [--steps 3] [--top 12]   (table in docs/benchmarks.md)
     .venv/bin/python bench/step_profile.py --quick   (seq 64, one step, no compile: that it runs)

The embedded SmolLM2-135M, LoRA r=8 on q_proj and v_proj, micro-batch 4 x seq 256, fp32. Each side
runs one warm-up step (compilation, optimizer state), then `--steps` profiled steps. Self CPU time
per op, summed over the profiled steps, as a share of the side's profiled wall time.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="seq 64, micro-batch 1, one profiled step, no compile")
    args = ap.parse_args()
    seq, micro = (64, 1) if args.quick else (256, 4)
    if args.quick:
        args.steps = 1
    warnings.filterwarnings("ignore")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import peft
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from trainplan import config as C
    from trainplan import resolve
    from trainplan.features.torch_compile import engine as torch_compile
    from trainplan.run import data, step, weights

    transformers.logging.set_verbosity_error()
    sets = [
        "mode=lora",
        "precision=fp32",
        f"batch.seq_len={seq}",
        f"batch.micro_batch_size={micro}",
        "hardware.gpus=cpu",
    ]
    cfg = C.load(None, sets)
    r = resolve.resolve(cfg)
    tokenizer = weights.load_tokenizer(cfg, r.spec)
    train_docs, _ = data.split_documents(data.load_documents("default"), 0.1)
    packed = data.pack(train_docs, tokenizer, seq, r.spec.vocab_size)
    ids, labels = packed.ids, packed.labels
    batches = [
        {"input_ids": ids[i * micro : (i + 1) * micro], "labels": labels[i * micro : (i + 1) * micro]} for i in range(8)
    ]

    def trainplan_step(compiled: bool):
        torch.manual_seed(0)
        model = weights.load_model(cfg, r.spec, r.precision, torch.device("cpu"))
        if compiled:
            torch_compile.compile_layers(model)
        opt = step.build_optimizer(model, "adamw", "auto", 1e-3, 0.0, "cpu")
        settings = step.StepSettings(prec=r.precision, device_type="cpu")
        return lambda b: step.train_step(model, step.Update(opt), [b], settings)

    def hf_step():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(weights.weights_dir(cfg)), dtype=torch.float32)
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, lora)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def run(b):  # what Trainer's training_step + optimizer step do, without its bookkeeping
            model(**b).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    sides = {"trainplan (fused loss)": trainplan_step(False)}
    if not args.quick:
        sides["trainplan, train.compile"] = trainplan_step(True)
    sides["HF Trainer's step (PEFT, transformers' loss)"] = hf_step()
    for name, run in sides.items():
        run(batches[0])  # warm-up: compilation, optimizer state
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for b in batches[1 : 1 + args.steps]:
                run(b)
            wall = time.perf_counter() - t0
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        print(f"\n### {name}: {args.steps} steps, {wall / args.steps:.2f} s per step\n")
        print("| op | self CPU s / step | share | calls / step |")
        print("|---|---:|---:|---:|")
        for e in rows:
            secs = e.self_cpu_time_total / 1e6 / args.steps
            print(f"| `{e.key}` | {secs:.3f} | {secs * args.steps / wall:.0%} | {e.count // args.steps} |")


if __name__ == "__main__":
    main()
