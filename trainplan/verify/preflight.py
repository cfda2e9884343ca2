"""`trainplan devices`: what this machine has, and whether it works, before a run occupies it.

Inventory: CUDA GPUs through torch and NVML (pynvml, else nvidia-smi), otherwise the CPU; for each
device its capacity and free memory, compute capability and bf16 support, plus the driver and CUDA
versions and, with several GPUs, peer-to-peer access between each pair.

Health checks:
- determinism: one identical tiny training step (trainplan's own builder and step) run twice on
  each device must give bit-identical losses, and GPUs of the same model must agree bitwise;
- matmul: a large bf16 matrix product's TFLOP/s against the catalog's nominal dense figure
  (on the CPU, an fp32 product, reported without a nominal figure: the catalog has none);
- all-reduce: correctness and bus bandwidth through torch.distributed (NCCL with several GPUs;
  two gloo processes on the CPU with --allreduce-cpu). busbw = algbw x 2(n-1)/n (nccl-tests'
  convention for all-reduce).
Whatever was not checked is listed, with the reason.

Imports no torch at module level: the CLI builds every subcommand's parser on each call, and the
analytic `trainplan plan` path must stay torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainplan.spec import devices as catalog

SCHEMA = "trainplan.devices/1"
GPU_MATMUL_SIZE, CPU_MATMUL_SIZE = 8192, 1024
MIN_MATMUL_RATIO = 0.5  # of the catalog's nominal TFLOP/s; an H200 reaches about 0.8 on random data
TINY_PRESET = "tiny-llama"  # the determinism check steps the test suite's tiny Llama (spec/presets)


@dataclass(kw_only=True)
class DeviceInfo:
    label: str  # "cpu", "cuda:0"
    kind: str  # cpu | cuda
    name: str
    capacity_bytes: int
    free_bytes: int | None
    compute: str  # GPU: compute capability "9.0"; CPU: torch's vector capability, e.g. "AVX512"
    bf16: bool  # native bf16 arithmetic
    bf16_detail: str
    catalog: str | None = None  # matching catalog entry
    nominal_tflops: float | None = None  # catalog's dense bf16 figure
    cores: int | None = None  # CPU: logical cores; GPU: streaming multiprocessors
    nvml: dict | None = None  # GPU: NVML's memory, temperature, power


@dataclass(kw_only=True)
class Inventory:
    devices: list[DeviceInfo]
    versions: dict[str, str]
    nvml_source: str  # pynvml | nvidia-smi | "NVML not available"
    p2p: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> list[DeviceInfo]:
        return [d for d in self.devices if d.kind == "cuda"]


@dataclass(kw_only=True)
class CheckResult:
    name: str
    passed: bool | None  # None: ran, but there is no criterion to pass (reported only)
    summary: str
    evidence: dict = field(default_factory=dict)


# ---- inventory ------------------------------------------------------------------------------


def catalog_entry(name: str) -> catalog.DeviceSpec | None:
    """The catalog device a reported name denotes ('NVIDIA H200' -> H200-141GB)."""
    return catalog.reported(name)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cpuinfo() -> tuple[str, set[str]]:
    """CPU model name and feature flags (x86 'flags', Arm 'Features')."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "model name" and v.strip():
                    name = v.strip()
                elif k in ("flags", "Features") and not flags:
                    flags = set(v.split())
    except OSError:
        pass
    return name, flags


def cpu_info() -> DeviceInfo:
    import torch

    name, flags = _cpuinfo()
    mem = _meminfo()
    native = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return DeviceInfo(
        label="cpu",
        kind="cpu",
        name=name,
        capacity_bytes=mem.get("MemTotal") or catalog.host_memory_bytes(),
        free_bytes=mem.get("MemAvailable"),
        compute=torch.backends.cpu.get_cpu_capability(),
        bf16=bool(native),
        bf16_detail=f"native ({', '.join(native)})" if native else "emulated (no avx512_bf16 / amx_bf16 / bf16 flag)",
        cores=os.cpu_count(),
    )


def _nvml_versions() -> tuple[str, dict[str, str]]:
    """NVML's source and the driver / CUDA-driver versions it reports."""
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return "pynvml", {
            "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
        }
    except Exception:  # no pynvml, or no NVIDIA driver
        pass
    rows = catalog.nvidia_smi("driver_version")
    if rows:
        return "nvidia-smi", {"driver": rows[0][0]}
    return "NVML not available", {"driver": "none"}


def _number(text: str, scale: int = 1) -> float | None:
    """nvidia-smi's value, or None for '[N/A]' and the like."""
    try:
        return float(text) * scale
    except ValueError:
        return None


def _nvml_device(index: int, source: str) -> dict | None:
    """NVML's view of torch's device `index` (torch maps CUDA_VISIBLE_DEVICES to NVML indices)."""
    import torch

    if source == "pynvml":
        out = {}
        for key, fn in (
            ("used_bytes", torch.cuda.device_memory_used),
            ("temperature_c", torch.cuda.temperature),
            ("power_w", lambda i: torch.cuda.power_draw(i) / 1000),
            ("sm_clock_mhz", torch.cuda.clock_rate),
        ):
            try:
                out[key] = fn(index)
            except Exception:  # a query the driver or card does not support
                out[key] = None
        return out
    if source == "nvidia-smi" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        rows = catalog.nvidia_smi("memory.used,temperature.gpu,power.draw")
        if index < len(rows):
            used, temp, power = rows[index]
            return {"used_bytes": _number(used, catalog.MiB), "temperature_c": _number(temp), "power_w": _number(power)}
    return None


def gpu_info(index: int, nvml_source: str) -> DeviceInfo:
    import torch

    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    known = catalog_entry(props.name)
    bf16 = props.major >= 8
    return DeviceInfo(
        label=f"cuda:{index}",
        kind="cuda",
        name=props.name,
        capacity_bytes=total,
        free_bytes=free,
        compute=f"{props.major}.{props.minor}",
        bf16=bf16,
        bf16_detail="native (compute capability >= 8.0)" if bf16 else "no bf16 tensor cores (compute capability < 8.0)",
        catalog=known.name if known else None,
        nominal_tflops=known.peak_tflops if known else None,
        cores=props.multi_processor_count,
        nvml=_nvml_device(index, nvml_source),
    )


def inventory() -> Inventory:
    """The devices of this machine: every CUDA GPU torch sees, otherwise the CPU."""
    import torch

    source, versions = _nvml_versions()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        **versions,
    }
    notes = []
    if not torch.cuda.is_available():
        smi = catalog.nvidia_smi("name")
        if smi:
            notes.append(
                f"nvidia-smi sees {len(smi)} GPU(s) ({smi[0][0]}) but torch {torch.__version__} cannot use CUDA: "
                "install a CUDA build of torch"
            )
        return Inventory(devices=[cpu_info()], versions=versions, nvml_source=source, notes=notes)
    n = torch.cuda.device_count()
    gpus = [gpu_info(i, source) for i in range(n)]
    p2p = [
        {"from": i, "to": j, "access": torch.cuda.can_device_access_peer(i, j)}
        for i in range(n)
        for j in range(n)
        if i != j
    ]
    return Inventory(devices=gpus, versions=versions, nvml_source=source, p2p=p2p, notes=notes)


# ---- health checks --------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def tiny_step_losses(device: str, seed: int = 0) -> tuple[float, float]:
    """One AdamW step of a 2-layer Llama through trainplan's builder and step: (loss, loss after).

    Weights and batch come from the CPU generator under `seed`, so every device starts from
    identical numbers; eager attention and fp32 keep the kernels deterministic.
    """
    import torch

    from trainplan import config as C
    from trainplan.run import build, step
    from trainplan.spec.model import load_model_spec
    from trainplan.spec.precision import PRECISIONS

    spec = load_model_spec(TINY_PRESET)
    cfg = C.load(None, ["mode='full'", "precision='fp32'", "memory.attention='eager'"])
    prec = PRECISIONS["fp32"]
    torch.manual_seed(seed)
    model = build.materialize(build.build_model(spec, cfg, prec), "cpu").to(device)
    ids = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    batch = {"input_ids": ids, "labels": ids.clone()}
    optimizer = step.build_optimizer(model, "adamw", "for-loop", 1e-3, 0.0, device.split(":")[0])
    settings = step.StepSettings(prec=prec, device_type=device.split(":")[0])
    result = step.train_step(model, step.Update(optimizer), [batch], settings)
    with torch.no_grad():
        after = model(**batch).loss
    _sync(device)
    return float(result.loss), float(after)


def check_determinism(devices: list[DeviceInfo], seed: int = 0, second_seed: int | None = None) -> CheckResult:
    """Run the tiny step twice per device (the second time with `second_seed`, default `seed`):
    the losses must be bit-identical on each device, and across devices of the same model."""
    second = seed if second_seed is None else second_seed
    runs = {d.label: (tiny_step_losses(d.label, seed), tiny_step_losses(d.label, second)) for d in devices}
    hexes = {label: ([x.hex() for x in a], [x.hex() for x in b]) for label, (a, b) in runs.items()}
    repeat_ok = {  # bitwise equal, and finite: two NaNs have the same bits
        label: hexes[label][0] == hexes[label][1] and all(math.isfinite(x) for x in a + b)
        for label, (a, b) in runs.items()
    }
    by_model: dict[str, list[str]] = {}
    for d in devices:
        by_model.setdefault(d.name, []).append(d.label)
    cross_ok = {
        name: len({tuple(hexes[label][0]) for label in labels}) == 1
        for name, labels in by_model.items()
        if len(labels) > 1
    }
    passed = all(repeat_ok.values()) and all(cross_ok.values())
    bad = [label for label, ok in repeat_ok.items() if not ok] + [n for n, ok in cross_ok.items() if not ok]
    first = next(iter(runs.values()))[0]
    summary = (
        f"tiny training step twice per device: bit-identical losses ({first[0].hex()} -> {first[1].hex()})"
        if passed
        else f"losses differ on {', '.join(bad)}"
    )
    if cross_ok and passed:
        summary += f"; identical across {sum(len(v) for v in by_model.values() if len(v) > 1)} GPUs of one model"
    evidence = {
        "seeds": [seed, second],
        "losses": {label: [a, b] for label, (a, b) in hexes.items()},
        "repeat_identical": repeat_ok,
        "cross_device_identical": cross_ok,
    }
    return CheckResult(name="determinism", passed=passed, summary=summary, evidence=evidence)


def matmul_tflops(device: str, size: int, reps: int) -> dict:
    """Median TFLOP/s of size^3 products on random data: bf16 on GPUs, fp32 on the CPU."""
    import torch

    gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    pairs = [
        (
            torch.randn(size, size, device=device, dtype=dtype, generator=gen),
            torch.randn(size, size, device=device, dtype=dtype, generator=gen),
        )
        for _ in range(2)
    ]  # two input sets, alternated, so repeated products do not just re-read one cached set
    times = []
    for i in range(reps + 2):  # two warm-ups: handles, heuristics, clocks
        a, b = pairs[i % 2]
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        if i >= 2:
            times.append(seconds)
    median = statistics.median(times)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "reps": reps,
        "seconds_median": median,
        "tflops": 2 * size**3 / median / 1e12,
    }


def check_matmul(dev: DeviceInfo, size: int, reps: int, min_ratio: float = MIN_MATMUL_RATIO) -> CheckResult:
    m = matmul_tflops(dev.label, size, reps)
    what = f"{m['dtype']} {size}^3 on {dev.label}: {m['tflops']:.2f} TFLOP/s (median of {reps})"
    if dev.kind == "cpu":
        return CheckResult(
            name=f"matmul {dev.label}", passed=None, summary=what + "; no nominal figure for the CPU", evidence=m
        )
    if not dev.nominal_tflops:
        return CheckResult(
            name=f"matmul {dev.label}",
            passed=None,
            summary=what + f"; {dev.name} is not in the catalog: no nominal figure",
            evidence=m,
        )
    ratio = m["tflops"] / dev.nominal_tflops
    m.update(nominal_tflops=dev.nominal_tflops, ratio=ratio, min_ratio=min_ratio)
    return CheckResult(
        name=f"matmul {dev.label}",
        passed=ratio >= min_ratio,
        summary=f"{what} = {ratio:.0%} of the catalog's {dev.nominal_tflops:g} ({dev.catalog}); "
        f"needs >= {min_ratio:.0%}",
        evidence=m,
    )


def _allreduce_worker(rank: int, world: int, store_path: str, backend: str, numel: int, iters: int, out: str) -> None:
    """One rank of the all-reduce check (torch.multiprocessing.spawn's target)."""
    import torch
    import torch.distributed as dist

    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        base = (torch.arange(numel, device=device) % 251).float()  # small integers: exact in fp32 sums
        t = base + rank
        dist.all_reduce(t)
        correct = bool(torch.equal(t, base * world + world * (world - 1) / 2))
        buf = torch.ones(numel, device=device)
        dist.all_reduce(buf)  # warm-up: connections, buffers
        times = []
        for _ in range(iters):
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            _sync(device)
            times.append(time.perf_counter() - t0)
        result = {"rank": rank, "correct": correct, "seconds": times}
        dist.destroy_process_group()
    except Exception as e:  # reported by the parent as a failed check
        result = {"rank": rank, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a gloo rank can abort at interpreter exit even after a clean destroy


def check_allreduce(world: int, backend: str, mib: float, iters: int = 5, timeout_s: float = 120) -> CheckResult:
    """All-reduce (sum) over `world` local processes: exact result on every rank, and bus bandwidth."""
    import torch.multiprocessing as mp

    numel = max(1, int(mib * catalog.MiB) // 4)
    with tempfile.TemporaryDirectory(prefix="trainplan-allreduce-") as tmp:
        ctx = mp.spawn(
            _allreduce_worker,
            args=(world, str(Path(tmp) / "store"), backend, numel, iters, tmp),
            nprocs=world,
            join=False,
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.terminate()
                return CheckResult(name="all-reduce", passed=False, summary=f"{backend}: no result in {timeout_s:g} s")
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    errors = [r["error"] for r in results if "error" in r]
    if errors or len(results) != world:
        return CheckResult(
            name="all-reduce",
            passed=False,
            summary=f"{backend}: {errors[0] if errors else f'{len(results)} of {world} ranks reported'}",
            evidence={"ranks": results},
        )
    seconds = statistics.median(max(r["seconds"][i] for r in results) for i in range(iters))  # slowest rank
    algbw = numel * 4 / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world
    correct = all(r["correct"] for r in results)
    evidence = {
        "backend": backend,
        "world": world,
        "bytes": numel * 4,
        "iters": iters,
        "seconds_median": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "correct_per_rank": [r["correct"] for r in results],
    }
    summary = (
        f"{backend}, {world} ranks, {numel * 4 / catalog.MiB:g} MiB: "
        f"{'exact sums on every rank' if correct else 'WRONG sums'}; bus bandwidth {busbw:.2f} GB/s"
    )
    return CheckResult(name="all-reduce", passed=correct, summary=summary, evidence=evidence)


def health_checks(
    inv: Inventory, targets: list[DeviceInfo], args: argparse.Namespace
) -> tuple[list[CheckResult], list[str]]:
    """Run the checks that apply here; return them and the list of what was not checked, and why."""
    checks, not_checked = [], []
    gpus = [d for d in targets if d.kind == "cuda"]
    if not inv.gpus:
        not_checked.append(
            "GPU inventory (compute capability, free memory, NVML, driver): no CUDA device visible to torch"
        )
    if len(inv.gpus) < 2:
        not_checked.append(f"P2P access between GPUs: {len(inv.gpus)} GPU(s)")
    if inv.nvml_source == "NVML not available" and inv.gpus:
        not_checked.append("NVML memory, temperature and power: NVML not available (no pynvml, no nvidia-smi)")
    if args.skip_health:
        not_checked.append("health checks (determinism, matmul, all-reduce): --skip-health")
        return checks, not_checked
    checks.append(check_determinism(targets))
    if len(targets) < 2:
        not_checked.append(f"cross-device loss identity: one device ({targets[0].label}) checked")
    for dev in targets:
        size = args.matmul_size or (GPU_MATMUL_SIZE if dev.kind == "cuda" else CPU_MATMUL_SIZE)
        checks.append(check_matmul(dev, size, args.matmul_reps, args.min_matmul_ratio))
    if not gpus:
        not_checked.append("bf16 matmul TFLOP/s against the catalog's nominal figure: no GPU")
    if len(gpus) >= 2:
        checks.append(check_allreduce(len(gpus), "nccl", args.allreduce_mib or 256, iters=10))
    else:
        not_checked.append(f"NCCL all-reduce correctness and bus bandwidth: {len(gpus)} GPU(s) checked, needs 2")
    if args.allreduce_cpu and not gpus:
        checks.append(check_allreduce(2, "gloo", args.allreduce_mib or 8, iters=5))
    elif not gpus:
        not_checked.append("gloo all-reduce on the CPU: not requested (--allreduce-cpu runs 2 gloo processes)")
    return checks, not_checked


def report(inv: Inventory, checks: list[CheckResult], not_checked: list[str]) -> dict:
    failed = [c.name for c in checks if c.passed is False]
    return {
        "schema": SCHEMA,
        "inventory": {
            "devices": [dataclasses.asdict(d) for d in inv.devices],
            "versions": inv.versions,
            "nvml": inv.nvml_source,
            "p2p": inv.p2p,
            "notes": inv.notes,
        },
        "checks": [dataclasses.asdict(c) for c in checks],
        "not_checked": not_checked,
        "passed": not failed,
        "failed": failed,
    }
