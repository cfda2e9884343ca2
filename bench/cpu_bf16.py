"""Why precision = "auto" is fp32 on the CPU: 16-bit matmuls against fp32 on this machine's cores.

Run: .venv/bin/python bench/cpu_bf16.py   (figures recorded in docs/benchmarks.md)
     .venv/bin/python bench/cpu_bf16.py --quick   (an eighth of each width, one timing: that it runs)

Times, in one process and one torch thread, the two matmuls that dominate a training step of the
embedded default (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49,152) in fp32, bf16 and fp16
(what autocast runs). Prints medians and the ratio to fp32, with the CPU's 16-bit instruction flags:
without AVX512-BF16 or AMX, torch emulates bf16 and the ratio is tens of times.
"""

from __future__ import annotations

import argparse

import torch
from plan_speed import median_time  # bench/ is on the path when a script in it runs

from trainplan.spec.devices import cpu_native_16bit


def median_s(fn, repeat: int) -> float:
    fn()  # warm
    return median_time(fn, repeat)


def matmuls(scale: int = 1, repeat: int = 5) -> list[tuple[str, str, float]]:
    shapes = {"MLP (1024x576 @ 576x1536)": (1024, 576, 1536), "head chunk (128x576 @ 576x49152)": (128, 576, 49152)}
    rows = []
    for label, (m, k, n) in shapes.items():
        m, k, n = m // scale, k // scale, n // scale
        label = label if scale == 1 else f"{label}, each width / {scale}"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            rows.append((label, str(dtype).removeprefix("torch."), median_s(lambda a=a, b=b: a @ b, repeat)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="each width / 8, one timing")
    quick = ap.parse_args().quick
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16 {cpu_native_16bit('bf16')}, native fp16 {cpu_native_16bit('fp16')}")  # fmt: skip
    rows = matmuls(8, 1) if quick else matmuls()
    fp32 = {label: s for label, dtype, s in rows if dtype == "float32"}
    width = max(len(label) for label, _, _ in rows)
    print(f"{'matmul':{width}} {'dtype':9} {'median ms':>10} {'x fp32':>7}")
    for label, dtype, s in rows:
        print(f"{label:{width}} {dtype:9} {s * 1e3:10.2f} {s / fp32[label]:7.1f}")


if __name__ == "__main__":
    main()
