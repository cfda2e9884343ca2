import pytest

from trainplan.errors import ConfigError
from trainplan.spec import devices as D


def test_count_times_name():
    devs = D.parse_devices("8xH100-80GB")
    assert len(devs) == 8 and {d.name for d in devs} == {"H100-80GB"}
    assert devs[0].capacity_bytes == 81559 * D.MiB


def test_heterogeneous_list_keeps_each_device():
    devs = D.parse_devices("A100-80GB,RTX4090")
    assert [d.name for d in devs] == ["A100-80GB", "RTX4090"]
    assert devs[0].capacity_bytes > devs[1].capacity_bytes


def test_names_are_forgiving_about_case_and_dashes():
    assert D.lookup("rtx-4090").name == "RTX4090"
    assert D.lookup("h100").name == "H100-80GB"


def test_bare_capacity_and_gpu_mem_override():
    (dev,) = D.parse_devices("24GiB")
    assert dev.capacity_bytes == 24 * D.GiB and dev.is_gpu
    devs = D.parse_devices("2xA100-80GB", gpu_mem="40GiB")
    assert all(d.capacity_bytes == 40 * D.GiB for d in devs)
    (generic,) = D.parse_devices("auto", gpu_mem="16GiB")
    assert generic.capacity_bytes == 16 * D.GiB


def test_unknown_device_suggests_catalog_names():
    with pytest.raises(ConfigError, match=r"hardware\.gpus: unknown device 'H10-80GB'; did you mean 'H100-80GB'"):
        D.parse_devices("H10-80GB")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4090", "'4090' is neither a device nor a size; for the GPU write RTX4090; for a size write 4090GiB"),
        ("2x4090", "'4090' is neither a device nor a size; for the GPU write RTX4090"),
        ("A100-80GB,24", "'24' is neither a device nor a size; for a size write 24GiB"),
    ],
)
def test_a_bare_number_is_never_read_as_gib(text, message):
    """`--gpus 2x4090` once planned two GPUs of 4090 GiB each, and said FITS."""
    with pytest.raises(ConfigError, match="^hardware.gpus: " + message):
        D.parse_devices(text)
    with pytest.raises(ConfigError, match="^hardware.gpu_mem: '24' has no unit; write it like 24GiB"):
        D.parse_devices("A100-80GB", gpu_mem="24")


def test_catalog_has_required_devices_with_bf16_flags():
    for name in (
        "A100-40GB",
        "A100-80GB",
        "H100-80GB",
        "H200-141GB",
        "L4",
        "A10G",
        "RTX3090",
        "RTX4090",
        "V100-16GB",
        "V100-32GB",
        "T4",
        "MI300X",
    ):
        assert name in D.CATALOG
    assert not D.CATALOG["V100-16GB"].bf16 and not D.CATALOG["T4"].bf16
    assert D.CATALOG["H100-80GB"].bf16


@pytest.mark.parametrize(
    ("text", "expected"), [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("2 TiB", 2 * 2**40)]
)
def test_parse_size(text, expected):
    assert D.parse_size(text, "f") == expected


@pytest.mark.parametrize("text", ["-1GiB", "lots", "0GiB", "24"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="^f: "):
        D.parse_size(text, "f")


def test_cpu_is_a_device_with_host_memory():
    (cpu,) = D.parse_devices("cpu")
    assert cpu.kind == "cpu" and cpu.capacity_bytes == D.host_memory_bytes() > 0


@pytest.mark.parametrize(
    ("reported", "catalog"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),  # not an L4: a digit follows the match
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ],
)
def test_reported_gpu_names_map_to_the_catalog(reported, catalog):
    found = D.reported(reported)
    assert (found.name if found else None) == catalog


@pytest.mark.multiprocess
def test_detect_reads_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH: each GPU on its own, matched to the catalog where known."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA H100 80GB HBM3, 81559\\nNVIDIA L40S, 46068\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    h100, l40s = D.detect()
    assert (h100.name, h100.kind, h100.capacity_bytes) == ("NVIDIA H100 80GB HBM3", "cuda", 81559 * D.MiB)
    assert h100.peak_tflops == D.CATALOG["H100-80GB"].peak_tflops
    assert l40s.capacity_bytes == 46068 * D.MiB and l40s.peak_tflops is None  # unknown card: no nominal figure


@pytest.mark.parametrize(
    "text, bf16, fp16",
    [
        ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n", False, False),  # an AVX2-only core: emulated
        ("flags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n", True, False),
        ("flags\t\t: avx512f avx512_fp16 amx_bf16 amx_tile amx_fp16\n", True, True),
        ("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16 i8mm\n", True, True),  # Arm
        ("processor\t: 0\n", False, False),  # says nothing
    ],
)
def test_native_16bit_math_is_read_from_the_cpus_flags(tmp_path, text, bf16, fp16):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert D.cpu_native_16bit("bf16", str(info)) is bf16
    assert D.cpu_native_16bit("fp16", str(info)) is fp16
    assert D.cpu_native_16bit("bf16", str(tmp_path / "absent")) is False
