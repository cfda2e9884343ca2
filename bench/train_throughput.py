"""Training throughput: trainplan's loop vs Hugging Face Trainer + PEFT, same everything.

Run: .venv/bin/python bench/train_throughput.py [--steps 8]   (figures in docs/benchmarks.md)
     .venv/bin/python bench/train_throughput.py --paired --compile --steps 12   (train.compile against HF's
     torch_compile=True)
     .venv/bin/python bench/train_throughput.py --quick [--compile]   (three paired steps at seq 64: that it runs)

Same process, same model (the embedded SmolLM2-135M), same LoRA (r=8 on q_proj, v_proj) or full
fine-tuning (--mode full), same packed Python-docs sequences, micro-batch 4 x seq 256 unless
--micro-batch / --seq say otherwise, AdamW, fp32 on this CPU. Tokens/s is
the median over steps after the first (warm-up); rounds alternate which loop runs first.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both loops")
    ap.add_argument("--paired", action="store_true", help="interleave the two loops step by step in one run")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="--paired: add trainplan's train.compile variant and run HF with torch_compile=True (its documented "
        "setting); the first two pairs (compilation) are dropped",
    )
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument(
        "--quick", action="store_true", help="paired, three steps of micro-batch 1 x seq 64 (with --compile, four)"
    )
    args = ap.parse_args()
    if args.quick:
        args.paired, args.micro_batch, args.seq = True, 1, 64
        args.steps = 4 if args.compile else 3
    warnings.filterwarnings("ignore")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU backend's import-time warning
    import peft
    import transformers

    from trainplan import config as C
    from trainplan import resolve
    from trainplan.features.torch_compile import engine as torch_compile
    from trainplan.run import data, step, weights

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    sets = [
        f"mode={args.mode}",
        "precision=fp32",
        f"batch.seq_len={args.seq}",
        f"batch.micro_batch_size={args.micro_batch}",
        "hardware.gpus=cpu",
        "optim.lr=1e-3",
        "lora.dropout=0.05",
    ]
    cfg = C.load(None, sets)
    r = resolve.resolve(cfg)
    tokenizer = weights.load_tokenizer(cfg, r.spec)
    train_docs, _ = data.split_documents(data.load_documents("default"), 0.1)
    packed = data.pack(train_docs, tokenizer, args.seq, r.spec.vocab_size)
    ids, labels = packed.ids, packed.labels
    micro = args.micro_batch
    tokens_per_step = micro * (args.seq - 1)

    def ours() -> list[float]:
        torch.manual_seed(0)
        model = weights.load_model(cfg, r.spec, r.precision, torch.device("cpu"))
        opt = step.build_optimizer(model, "adamw", "auto", 1e-3, 0.0, "cpu")
        times = []
        for i in range(args.steps):
            batch = [{"input_ids": ids[i * micro : (i + 1) * micro], "labels": labels[i * micro : (i + 1) * micro]}]
            t0 = time.perf_counter()
            step.train_step(model, step.Update(opt), batch, step.StepSettings(prec=r.precision, device_type="cpu"))
            times.append(time.perf_counter() - t0)
        return times

    def hf(interleave=None) -> list[float]:
        torch.manual_seed(0)
        directory = weights.weights_dir(cfg)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        if args.mode == "lora":
            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
                ),
            )
        rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(args.steps * micro)]
        times: list[float] = []

        class Timer(transformers.TrainerCallback):
            def on_step_begin(self, *a, **k):
                if interleave is not None and len(times) % 2 == 0:
                    interleave(len(times))  # one of our steps right before this HF step
                self.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                times.append(time.perf_counter() - self.t0)
                if interleave is not None and len(times) % 2 == 0:
                    interleave(len(times) - 1)  # ...and right after this one: the order alternates

        targs = transformers.TrainingArguments(
            output_dir="/tmp/trainplan-bench-hf",
            per_device_train_batch_size=micro,
            max_steps=args.steps,
            learning_rate=1e-3,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            lr_scheduler_type="constant",
            optim="adamw_torch",
            torch_compile=args.compile,
        )
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=rows, callbacks=[Timer()])
        trainer.train()
        return times

    if args.paired:
        # Step-paired: every model lives in this process and each HF Trainer step is adjacent to
        # one step of each trainplan variant (before it on even steps, after it on odd ones), so
        # drift of a noisy machine hits all alike. Ratios are medians of the per-step ratios.
        # Variants: the default (fused chunked loss) and train.fused_loss=false (transformers' loss).
        variants = {"fused loss (default)": cfg, "transformers' loss": C.load(None, [*sets, "train.fused_loss=false"])}
        if args.compile:  # regional compilation, as train.compile runs it
            variants["compiled, fused loss"] = C.load(None, [*sets, "train.compile=true"])
        runs = {}
        for name, vcfg in variants.items():
            torch.manual_seed(0)
            model = weights.load_model(vcfg, r.spec, r.precision, torch.device("cpu"))
            if vcfg.train.compile is True:
                torch_compile.compile_layers(model)
            runs[name] = (model, step.build_optimizer(model, "adamw", "auto", 1e-3, 0.0, "cpu"), [])

        def ours_steps(i: int) -> None:
            j = i % (ids.shape[0] // micro)
            batch = [{"input_ids": ids[j * micro : (j + 1) * micro], "labels": labels[j * micro : (j + 1) * micro]}]
            order = list(runs.values()) if i % 2 == 0 else list(runs.values())[::-1]
            for model, opt, times in order:
                t0 = time.perf_counter()
                step.train_step(model, step.Update(opt), batch, step.StepSettings(prec=r.precision, device_type="cpu"))
                times.append(time.perf_counter() - t0)

        hf_times = hf(interleave=ours_steps)
        skip = 2 if args.compile else 1  # warm-up, and compilation (the first step and its neighbours)
        b = statistics.median(tokens_per_step / h for h in hf_times[skip:])
        hf_name = ("HF Trainer + PEFT" if args.mode == "lora" else "HF Trainer") + (
            ", torch_compile" if args.compile else ""
        )
        print(f"{args.mode}, micro-batch {micro} x seq {args.seq}, {len(hf_times) - skip} pairs")
        print(f"{hf_name + ':':30s} {b:8.1f} tokens/s (median of {len(hf_times) - skip} steps)")
        if args.compile:
            first = runs["compiled, fused loss"][2][0]
            print(f"compile: HF's first step {hf_times[0]:.1f} s, trainplan's compiled variant's {first:.1f} s")
        for name, (_, _, times) in runs.items():
            pairs = list(zip(times[skip:], hf_times[skip:], strict=False))  # drop the warm-up pair(s)
            a = statistics.median(tokens_per_step / o for o, _ in pairs)
            ratio = statistics.median(h / o for o, h in pairs)
            print(
                f"trainplan, {name:20s} {a:8.1f} tokens/s; ratio to HF {ratio:.3f} "
                f"(median of {len(pairs)} per-step ratios)"
            )
        return

    ours_tps, hf_tps = [], []
    for i in range(args.rounds):  # alternate which goes first: the second run of a pair meets a warmer machine
        pair = [("ours", ours), ("hf", hf)] if i % 2 == 0 else [("hf", hf), ("ours", ours)]
        for name, fn in pair:
            (ours_tps if name == "ours" else hf_tps).extend(tokens_per_step / t for t in fn()[1:])
    a, b = statistics.median(ours_tps), statistics.median(hf_tps)
    print(f"trainplan loop:        {a:8.1f} tokens/s (median of {len(ours_tps)} steps)")
    print(f"HF Trainer + PEFT:     {b:8.1f} tokens/s (median of {len(hf_tps)} steps)")
    print(f"ratio trainplan / HF:  {a / b:.3f}")


if __name__ == "__main__":
    main()
