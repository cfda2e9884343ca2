"""The plan under train.compile (features/torch_compile/plan.py): what inductor's partitioner saves per layer, fitted
and cached. The run-level check (the compiled step's measured peak within 5 % of this plan) is in
tests/run/test_compile.py."""

import json
import subprocess
import sys

import pytest

from trainplan import config as C
from trainplan import resolve
from trainplan.features.torch_compile import plan as compiled
from trainplan.plan import activations as A
from trainplan.plan import analytic, derived

pytestmark = pytest.mark.slow  # each capture compiles a model's layers with inductor's passes


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "_FITS", {})  # this process's fits: none yet


def _cfg(tmp_path, tiny_llama, *sets: str):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_llama))
    return C.load(
        None,
        [f"model.source={path}", "model.init=random", "precision=fp32", "train.compile=true", *sets],
    )


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_compiled_layer_saves_less_than_the_eager_one_and_the_fit_holds_off_its_points(tmp_path, tiny_llama, mode):
    """Inductor's partitioner recomputes cheap element-wise ops rather than saving them: each layer
    saves less than eagerly. The fit's four points determine it, and a fifth (micro-batch 3, seq 96)
    captured on its own lands on it exactly."""
    r = resolve.resolve(_cfg(tmp_path, tiny_llama, f"mode={mode}"))
    fits = compiled.fits(r)
    first, rest = compiled._capture(r, 3, 96)
    assert (fits.first.nbytes(3, 96), fits.rest.nbytes(3, 96)) == (first, rest)
    ledger = analytic.plan(r.cfg)
    ((name, nbytes),) = ledger.devices[0].details["activations (one layer)"]
    assert name.startswith("decoder layer, compiled") and nbytes == fits.rest.nbytes(1, r.cfg.batch.seq_len)
    eager = analytic.plan(_cfg(tmp_path, tiny_llama, f"mode={mode}", "train.compile=false"))
    eager_layer = sum(n for _, n in eager.devices[0].details["activations (one layer)"])
    assert 0 < nbytes < 0.9 * eager_layer
    assert ledger.devices[0].peak_allocated < eager.devices[0].peak_allocated
    if mode == "lora":  # the first layer's input needs no gradient: its input norm saves nothing
        assert first < rest


@pytest.mark.multiprocess  # the warm plan runs in a fresh interpreter
def test_a_warm_compiled_plan_reads_the_cache_and_imports_no_torch(tmp_path, tiny_llama):
    cfg = _cfg(tmp_path, tiny_llama, "mode=lora")
    cold = analytic.plan(cfg)
    (entry,) = derived.cache_dir(cfg.model.cache_dir).glob("compiled-llama-*.json")
    argv = ["plan", "--model", str(tmp_path / "tiny.json"), "--set", "train.compile=true", "--mode", "lora"]
    argv += ["--set", "precision=fp32", "--set", "model.init=random", "--json"]
    code = (
        f"import sys; from trainplan.cli import main; rc = main({argv!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert warm.returncode == 0, warm.stderr[-2000:]
    entry.write_text("{not json")  # a damaged cache is captured again, not trusted (by a new process)
    compiled._FITS.clear()
    again = analytic.plan(cfg)
    assert again.devices[0].peak_allocated == cold.devices[0].peak_allocated and json.loads(entry.read_text())["rest"]


def test_compile_beside_tensor_parallelism_keeps_the_eager_terms_as_an_upper_bound(tmp_path, tiny_llama):
    sets = ["mode=full", "hardware.gpus=2xH100-80GB", "parallel.tp=2", "precision=amp-bf16"]
    ours = analytic.plan(_cfg(tmp_path, tiny_llama, *sets))
    eager = analytic.plan(_cfg(tmp_path, tiny_llama, *sets, "train.compile=false"))
    assert ours.devices[0].phases == eager.devices[0].phases and not compiled._FITS


def test_under_fsdp_the_layers_are_captured_in_its_mixed_precision(tmp_path, tiny_llama):
    """FSDP2's MixedPrecisionPolicy computes in bf16 without autocast, the residual stream included;
    DDP's autocast keeps the full fine-tune's residual stream in fp32: the compiled layers differ."""
    sets = ["mode=full", "precision=amp-bf16", "hardware.gpus=2xH100-80GB"]
    ddp = analytic.plan(_cfg(tmp_path, tiny_llama, *sets, "parallel.strategy=ddp"))
    fsdp = analytic.plan(_cfg(tmp_path, tiny_llama, *sets, "parallel.strategy=zero3"))
    layer = [sum(n for _, n in led.devices[0].details["activations (one layer)"]) for led in (ddp, fsdp)]
    assert 0 < layer[1] < layer[0] and len(list((tmp_path / "cache").glob("derived/compiled-*.json"))) == 2


def test_eager_layer_terms_stay_when_compile_is_off(tmp_path, tiny_llama):
    cfg = _cfg(tmp_path, tiny_llama, "mode=lora", "train.compile=false")
    r = resolve.resolve(cfg)
    ledger = analytic.plan(cfg)
    names = [n for n, _ in ledger.devices[0].details["activations (one layer)"]]
    assert names == [s.name for s in A.layer_saved(r.spec, _act(r))] and not list((tmp_path / "cache").glob("**/*"))


def _act(r):
    from trainplan.plan import context

    return context.rank_context(r, 0).act
