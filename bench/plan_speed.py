"""How fast is `trainplan plan`, and how does it compare with accelerate's estimator?

Run: .venv/bin/python bench/plan_speed.py   (figures recorded in docs/benchmarks.md)
     .venv/bin/python bench/plan_speed.py --quick   (the first case, three plans, one CLI run: that it runs)

Targets (issue 2): the CLI answers in < 0.5 s wall, one plan computes in < 50 ms, and the
analytic path imports no torch. The competitor, accelerate's `estimate-memory`, is run in the
same process on the same config: its own functions (calculate_maximum_sizes on a meta-device
model + estimate_training_usage), since its CLI needs the Hub.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

GiB = 2**30
CASES = [  # (label, settings)
    ("SmolLM2-135M default, cpu", {"hardware.gpus": "cpu"}),
    ("Llama-3.1-8B full, 1xH100, seq 512", {"model.source": "Llama-3.1-8B", "hardware.gpus": "H100-80GB"}),
    (
        "Llama-3.1-70B zero3, 8xH100, seq 4096",
        {
            "model.source": "Llama-3.1-70B",
            "hardware.gpus": "8xH100-80GB",
            "parallel.strategy": "zero3",
            "batch.seq_len": 4096,
        },
    ),
]


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cli_wall(args: list[str], repeat: int = 9) -> float:
    return median_time(
        lambda: subprocess.run([sys.executable, "-m", "trainplan", *args], capture_output=True, check=False), repeat
    )


def no_torch_on_analytic_path() -> bool:
    code = (
        "import sys; from trainplan.cli import main; main(['plan', '--gpus', 'cpu', '--json']); "
        "print(json.dumps('torch' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1]) is False


def accelerate_estimate(preset: str) -> tuple[float, int]:
    """accelerate's training estimate for the preset, and the seconds it took (median of 3)."""
    import torch
    import transformers
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    from trainplan.spec.model import preset_config

    cfg = preset_config(preset)
    result = {}

    def run():
        hf = transformers.CONFIG_MAPPING[cfg["model_type"]](**cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf)
        total, _ = calculate_maximum_sizes(model)
        result["bytes"] = max(estimate_training_usage(total, "bfloat16").values())

    return median_time(run, 3), result["bytes"]


def main() -> None:
    import argparse

    from trainplan import config as C
    from trainplan.plan.analytic import plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first case, three plans and one CLI run each")
    quick = ap.parse_args().quick
    plans, walls = (3, 1) if quick else (50, 9)
    print(f"{'case':42s} {'plan() median':>14s} {'CLI wall median':>16s}")
    for label, settings in CASES[:1] if quick else CASES:
        cfg = C.load(None, [], settings)
        in_proc = median_time(lambda cfg=cfg: plan(cfg), plans)
        args = ["plan"] + [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
        wall = cli_wall(args, walls)
        print(f"{label:42s} {in_proc * 1e3:11.1f} ms {wall:13.3f} s")
    print(f"analytic path imports torch: {not no_torch_on_analytic_path()}")

    print("\nside by side with accelerate estimate-memory (bf16 training, Adam), Llama-3.1-8B on one H100:")
    cfg = C.load(None, [], {"model.source": "Llama-3.1-8B", "hardware.gpus": "H100-80GB"})
    ours_s = median_time(lambda: plan(cfg), plans)
    ours = plan(cfg).devices[0]
    acc_s, acc_bytes = accelerate_estimate("Llama-3.1-8B")
    print(
        f"  trainplan: {ours.total_bytes / GiB:7.2f} GiB (peak {ours.peak_phase}, batch 1 x seq 512, "
        f"every component summed) in {ours_s * 1e3:.1f} ms"
    )
    print(
        f"  accelerate: {acc_bytes / GiB:6.2f} GiB (max() of model/grads/optimizer, no activations) "
        f"in {acc_s * 1e3:.0f} ms"
    )
    print(f"  ratio trainplan/accelerate: figure {ours.total_bytes / acc_bytes:.2f}x, time {ours_s / acc_s:.3f}x")


if __name__ == "__main__":
    main()
