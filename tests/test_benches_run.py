"""Every script in bench/ runs (issue 68): each has a quick mode, and the suite runs it, so a change that breaks
a bench fails CI instead of the next person who measures. (bench/train_throughput.py, bench/step_profile.py and
bench/checkpoint_overhead.py had stopped at their first line for a week: `data.pack` had come to return a
named tuple of six, and they unpacked two.) The quick modes check that a script runs to its end and prints its
result; the figures themselves come from the full runs, recorded in docs/ with their commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# script -> (its quick run's arguments, a line its output must hold)
QUICK = {
    "advise_speed.py": (["--quick"], r"CLI CPU \(user \+ system\), Llama-3\.1-70B on 8 x H100-80GB"),
    "checkpoint_overhead.py": (["--quick"], r"(?m)^lora : checkpoint +[\d.]+ MiB in"),
    "checkpointing.py": (["--quick"], r"\| 64 \| every layer \(30\) \| [\d.,]+ MiB \| [\d.,]+ MiB \|"),
    "cpu_bf16.py": (["--quick"], r"head chunk .* float32 +[\d.]+ +1\.0"),
    "derived_plan_speed.py": (["--quick"], r"\| Qwen3 \(0\.6B-shaped\) \| lora \| [\d.]+ \| [\d.]+ \|"),
    "docs_figures.py": (["--quick"], r"README\.md holds the demo markers once"),
    "fit_reserve.py": (["--quick"], r"(?m)^class lora: [\d.]+% over \d+ rows"),
    "model_sweep.py": (["--quick"], r"4 model_types of transformers [\d.]+, 8 plans: \d+ planned"),
    "plan_speed.py": (["--quick"], r"ratio trainplan/accelerate: figure [\d.]+x"),
    "qlora_published.py": (["--quick"], r"\| Llama-2 13B \| bnb\.nf4 \|"),
    "qlora_step.py": (["--quick"], r"\*\*total\*\*"),
    "reserved_replay.py": (["--quick"], r"replay within 3% of measured reserved: \d+/1"),
    "startup.py": (["--quick"], r"ratio to import torch: [\d.]+x"),
    "step_profile.py": (["--quick"], r"### HF Trainer's step \(PEFT, transformers' loss\): 1 steps"),
    "suite_time.py": (["--quick"], r"\| `.*tests/test_suite_time\.py` \| \d+ / 0 \|"),
    "trace_accuracy.py": (["--quick", "--family", "GPT-2"], r"1/1 traced"),
    "train_throughput.py": (["--quick"], r"trainplan, fused loss \(default\) +[\d.]+ tokens/s; ratio to HF [\d.]+"),
    "ui_latency.py": (["--quick"], r"the plan itself \(server side\): \d+ ms"),
}
# scripts whose quick mode another test runs already: script -> (that test file, the flag it passes)
ELSEWHERE = {
    "long_context.py": ("tests/test_long_context_bench.py", "--quick"),
    "gpu_validate.py": ("tests/test_devices_command.py", "--smoke"),
}


def test_every_bench_script_has_a_quick_mode_that_the_suite_runs():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == set(QUICK) | set(ELSEWHERE), "a bench without a quick run here, or one listed that is gone"
    for script in scripts:
        assert '"--quick"' in (BENCH / script).read_text(), f"bench/{script} has no --quick"
    for script, (test, flag) in ELSEWHERE.items():
        text = (ROOT / test).read_text()
        assert script in text and flag in text, (script, test)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("script", sorted(QUICK))
def test_a_bench_runs_to_its_end_in_its_quick_mode(script):
    args, expected = QUICK[script]
    if script == "ui_latency.py" and not (shutil.which("chromium") or shutil.which("chromium-browser")):
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs it from Debian's packages)")
        pytest.skip("chromium not installed")
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"bench/{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert re.search(expected, proc.stdout), proc.stdout[-3000:]
