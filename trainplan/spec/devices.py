"""Device catalog and device naming. Every device is planned on its own: memory never pools.

Capacities are the `memory.total` that nvidia-smi / rocm-smi report for the card (MiB), which
is what a process can address before the CUDA context; peak TFLOP/s are dense (no sparsity)
bf16 tensor-core figures with fp32 accumulation, from the vendors' datasheets. GeForce cards
run fp32-accumulate at half their fp16-accumulate rate, so their figures are the lower ones.
Link bandwidth is the nominal GB/s in each direction from one GPU to its peers (NVLink / Infinity
Fabric total over 2; PCIe x16 where the card has no GPU-to-GPU link), from the same datasheets.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace

from trainplan.errors import ConfigError, nearest

MiB = 1 << 20
GiB = 1 << 30


def format_gib(n: float | None, digits: int = 2, *, unit: bool = True) -> str:
    """Bytes as GiB with a fixed number of decimals ('-' for an unknown size; never '-0.00')."""
    if n is None:
        return "-"
    text = f"{n / GiB:.{digits}f}"
    if text.startswith("-") and float(text) == 0:
        text = text[1:]
    return f"{text} GiB" if unit else text


def gib(n: int) -> str:
    """Human bytes: GiB from 1 GiB up, MiB below."""
    if abs(n) >= GiB:
        return format_gib(n)
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    kind: str  # cuda | rocm | cpu
    capacity_bytes: int
    bf16: bool
    peak_tflops: float | None  # dense bf16 (fp16 where bf16 is missing)
    note: str = ""
    link_gbps: float | None = None  # GB/s per direction to peer GPUs

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"


def _gpu(name: str, mib: int, bf16: bool, tflops: float, note: str = "", kind: str = "cuda", link: float | None = None):
    return DeviceSpec(
        name=name, kind=kind, capacity_bytes=mib * MiB, bf16=bf16, peak_tflops=tflops, note=note, link_gbps=link
    )


CATALOG: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _gpu("A100-40GB", 40960, True, 312.0, link=300.0),  # NVLink 3: 600 GB/s
        _gpu("A100-80GB", 81920, True, 312.0, link=300.0),
        _gpu("H100-80GB", 81559, True, 989.0, "SXM5", link=450.0),  # NVLink 4: 900 GB/s
        _gpu("H200-141GB", 143771, True, 989.0, link=450.0),
        _gpu("L4", 23034, True, 121.0, link=32.0),  # PCIe 4.0 x16: 64 GB/s
        _gpu("A10G", 23028, True, 70.0, link=32.0),
        _gpu("RTX3090", 24576, True, 35.6, "fp32 accumulate", link=32.0),
        _gpu("RTX4090", 24564, True, 82.6, "fp32 accumulate", link=32.0),
        _gpu("V100-16GB", 16384, False, 125.0, "fp16 tensor cores; no bf16", link=150.0),  # SXM2 NVLink 2
        _gpu("V100-32GB", 32768, False, 125.0, "fp16 tensor cores; no bf16", link=150.0),
        _gpu("T4", 15360, False, 65.0, "fp16 tensor cores; no bf16", link=16.0),  # PCIe 3.0 x16
        _gpu("MI300X", 196608, True, 1307.4, kind="rocm", link=448.0),  # Infinity Fabric: 7 x 128 GB/s
    )
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY = {_key(n): d for n, d in CATALOG.items()}
# Common short names: "H100" is the 80 GB card, "A100" is ambiguous and left out on purpose.
_BY_KEY.update({"h100": CATALOG["H100-80GB"], "h200": CATALOG["H200-141GB"], "nvidiah200": CATALOG["H200-141GB"]})


def reported(name: str) -> DeviceSpec | None:
    """The catalog device that a name reported by CUDA or nvidia-smi denotes ('NVIDIA H100 80GB
    HBM3' -> H100-80GB): the longest catalog key inside it that no digit follows, so an 'NVIDIA
    L40S' is not taken for an L4."""
    key = _key(name)
    hits = [k for k in _BY_KEY if k and re.search(re.escape(k) + r"(?!\d)", key)]
    return _BY_KEY[max(hits, key=len)] if hits else None


# ASCII digits only (re.ASCII): `\d` would read "２４GiB" or "٣GiB" too
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)?\s*$", re.IGNORECASE | re.ASCII)
MAX_SIZE_BYTES = 1 << 60  # an exbibyte: far above any device or host
_UNITS = {
    "b": 1,
    "kib": 1 << 10,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str, field: str) -> int:
    """'24GiB' -> bytes. GiB/MiB are binary, GB/MB decimal. A bare number is refused: its unit
    would be a guess (and `--gpus 4090` usually means a GPU, not 4090 GiB)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(field, f"cannot read size {text!r}", "write it like 24GiB or 80GB")
    if m.group(2) is None:
        raise ConfigError(field, f"{str(text).strip()!r} has no unit", "write it like 24GiB or 80GB")
    if len(m.group(1)) > 24:
        raise ConfigError(
            field, f"size {str(text).strip()[:32]!r}... is past any device", "write it like 24GiB or 80GB"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(field, f"size must be positive (got {text!r})", "give a positive size")
    if value > MAX_SIZE_BYTES:
        raise ConfigError(
            field, f"size {str(text).strip()!r} is past any device (1 EiB)", "write it like 24GiB or 80GB"
        )
    return int(value)


def meminfo_bytes(key: str) -> int | None:
    """One field of Linux's /proc/meminfo ("MemTotal", "MemAvailable") in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_memory_bytes() -> int:
    """Physical memory of this machine (Linux /proc/meminfo; os.sysconf elsewhere)."""
    total = meminfo_bytes("MemTotal")
    return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_native_16bit(dtype: str, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes `dtype` ("bf16" or "fp16") matmuls in hardware (x86: AVX512-BF16 /
    AVX512-FP16 or AMX; Arm: the bf16 / fp16 features), read from Linux's /proc/cpuinfo. Elsewhere,
    or where the file says nothing: False. Without it torch still computes them, emulated."""
    wanted = {"bf16": {"avx512_bf16", "amx_bf16", "bf16"}, "fp16": {"avx512_fp16", "amx_fp16", "fphp"}}[dtype]
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return bool(wanted & set(value.split()))
    except OSError:
        pass
    return False


def cpu_device() -> DeviceSpec:
    return DeviceSpec(
        name="cpu",
        kind="cpu",
        capacity_bytes=host_memory_bytes(),
        bf16=True,
        peak_tflops=None,
        note="host memory; shared by every process on it",
    )


def lookup(name: str, field: str = "hardware.gpus") -> DeviceSpec:
    """One device by catalog name, 'cpu', or a bare capacity such as '24GiB'."""
    if _key(name) == "cpu":
        return cpu_device()
    dev = _BY_KEY.get(_key(name))
    if dev is not None:
        return dev
    bare = re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", name, re.ASCII)
    if bare:  # a model number or a size without its unit: say which devices it could mean
        named = [n for n in CATALOG if name.strip() in n]
        hint = f"for the GPU write {' or '.join(named)}; " if named else ""
        raise ConfigError(
            field, f"{name.strip()!r} is neither a device nor a size", f"{hint}for a size write {name.strip()}GiB"
        )
    if _SIZE_RE.match(name):
        cap = parse_size(name, field)
        return DeviceSpec(
            name=f"GPU-{name.strip()}",
            kind="cuda",
            capacity_bytes=cap,
            bf16=True,
            peak_tflops=None,
            note="generic GPU of the given capacity",
        )
    if _SIZE_LIKE.match(name):  # 'nanGiB', '-5GiB', 'inf', '1e400GB': a size that is not one
        raise ConfigError(
            field, f"{name.strip()[:40]!r} is not a size", "give a positive, finite number with its unit, e.g. 24GiB"
        )
    raise ConfigError(
        field, f"unknown device {name!r}", nearest(name, list(CATALOG) + ["cpu"]) + " (or give a size such as 24GiB)"
    )


_SIZE_LIKE = re.compile(
    r"^\s*[-+]?(nan|inf(inity)?|[\d.]+(e[-+]?\d+)?)\s*(KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)?\s*$", re.IGNORECASE | re.ASCII
)


def nvidia_smi(fields: str) -> list[list[str]]:
    """One row per GPU of `nvidia-smi --query-gpu=FIELDS` (no torch import); [] without it."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [[p.strip() for p in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def detect() -> list[DeviceSpec]:
    """The devices of this machine: NVIDIA GPUs via nvidia-smi (no torch import), else the CPU."""
    rows = nvidia_smi("name,memory.total")
    if rows:
        devices = []
        for *name_parts, mib in rows:
            gpu_name = ",".join(name_parts)
            known = reported(gpu_name)
            bf16 = known.bf16 if known else True
            tflops = known.peak_tflops if known else None
            devices.append(
                DeviceSpec(
                    name=gpu_name,
                    kind="cuda",
                    capacity_bytes=int(mib) * MiB,
                    bf16=bf16,
                    peak_tflops=tflops,
                    note="detected",
                    link_gbps=known.link_gbps if known else None,
                )
            )
        if devices:
            return devices
    return [cpu_device()]


MAX_DEVICE_COUNT = 65536  # a bound on one job's devices: larger counts are typos, and the plan is per rank


def parse_devices(text: str, gpu_mem: str | None = None, field: str = "hardware.gpus") -> list[DeviceSpec]:
    """'8xH100-80GB', 'A100-80GB,RTX4090', '2x24GiB', 'cpu', '4xcpu' or 'auto' -> one spec per rank."""
    if isinstance(text, str) and text.strip().lower() != "auto" and (gpu_mem is None or isinstance(gpu_mem, str)):
        return list(_parse_named(text, gpu_mem, field))  # the advisor parses the same text a thousand times
    return _parse(text, gpu_mem, field)


@functools.lru_cache(maxsize=256)
def _parse_named(text: str, gpu_mem: str | None, field: str) -> tuple[DeviceSpec, ...]:
    return tuple(_parse(text, gpu_mem, field))


def _parse(text: str, gpu_mem: str | None, field: str) -> list[DeviceSpec]:
    if not text or not str(text).strip():
        raise ConfigError(field, "is empty", "name devices like 8xH100-80GB, A100-80GB,RTX4090 or cpu")
    devices: list[DeviceSpec] = []
    if str(text).strip().lower() == "auto" and gpu_mem is not None:
        return [lookup(gpu_mem, "hardware.gpu_mem")]
    if str(text).strip().lower() == "auto":
        devices = detect()
    else:
        for part in str(text).split(","):
            m = re.match(r"^\s*(\d+)\s*[x×*]\s*(.+)$", part, re.ASCII)
            count, name = (int(m.group(1)), m.group(2)) if m else (1, part)
            if count > MAX_DEVICE_COUNT:
                raise ConfigError(
                    field,
                    f"{count} devices in {part.strip()!r} is more than trainplan plans for ({MAX_DEVICE_COUNT})",
                    "write the devices of the job, e.g. 64xH100-80GB",
                )
            if count < 1:
                raise ConfigError(
                    field, f"device count must be at least 1 in {part.strip()!r}", "write e.g. 8xH100-80GB"
                )
            devices += [lookup(name.strip(), field)] * count
    if gpu_mem is not None:
        cap = parse_size(gpu_mem, "hardware.gpu_mem")
        devices = [
            replace(d, capacity_bytes=cap, note=f"capacity set by gpu_mem={gpu_mem}") if d.is_gpu else d
            for d in devices
        ]
    return devices
