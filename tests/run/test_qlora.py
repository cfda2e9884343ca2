"""qlora on bitsandbytes' real 4-bit kernels, through their CPU backend (`allow_cpu`): NF4 base,
adapters the only trainable tensors, the lora contract, pretrained loading, and the refusal a
user gets without CUDA."""

import json

import pytest

from trainplan import config as C
from trainplan.errors import TrainplanError
from trainplan.features.qlora import engine as qlora
from trainplan.plan.analytic import NF4_BYTES, NF4_CONSTANTS_BYTES, plan
from trainplan.run import build, contract, record, weights
from trainplan.spec.model import load_model_spec
from trainplan.spec.parallel import build_parallel_dims
from trainplan.spec.precision import PRECISIONS

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")  # pinned in requirements.txt; CI installs it

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# bitsandbytes stores per quantized tensor, besides the absmax the plan counts: the 16-entry NF4
# code book and the 256-entry code book of the nested absmax (fp32 each), and the fp32 offset.
PER_TENSOR_CONSTANTS = 16 * 4 + 256 * 4 + 4


@pytest.fixture
def tiny_source(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def qlora_cfg(source, *extra):
    init = "random" if str(source).endswith(".json") else "auto"  # a config.json carries no weights
    return C.load(
        None,
        [f"model.source={source}", f"model.init={init}", "mode=qlora", "hardware.gpus=H100-80GB", "precision=amp-bf16"]
        + list(extra),
    )


def load(cfg, *, seed=0):
    torch.manual_seed(seed)
    spec = load_model_spec(cfg.model.source)
    return weights.load_model(cfg, spec, PRECISIONS[cfg.precision], torch.device("cpu"), allow_cpu=True)


def quantized(model):
    return {n: p for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}


def test_every_base_linear_is_nf4_and_only_the_adapters_train(tiny_source):
    model = load(qlora_cfg(tiny_source, "precision=amp-bf16", "lora.target_modules=['q_proj','v_proj']"))
    fours = quantized(model)
    assert len(fours) == TINY["num_hidden_layers"] * len(LINEARS)
    for name, p in fours.items():
        out_dim, in_dim = p.quant_state.shape
        assert p.dtype == torch.uint8 and p.numel() * p.element_size() == out_dim * in_dim // 2, name
        assert p.quant_state.quant_type == "nf4" and p.quant_state.nested  # double quantization
        assert p.quant_state.dtype == torch.bfloat16 and not p.requires_grad
    dense = {n: p for n, p in model.named_parameters() if n not in fours and "lora_" not in n}
    assert {n.rsplit(".", 2)[-2] for n in dense} >= {"embed_tokens", "lm_head", "norm"}
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in dense.values())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == TINY["num_hidden_layers"] * 2 * 2  # q and v: lora_A and lora_B each
    linear = model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(linear.base_layer, bnb.nn.Linear4bit) and linear.base_layer.compute_dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_training_changes_every_adapter_and_no_4bit_byte(tiny_source, precision):
    cfg = qlora_cfg(tiny_source, f"precision={precision}", f"lora.target_modules={list(LINEARS)}")
    model = load(cfg).train()
    absmax = {n: p.quant_state.absmax.clone() for n, p in quantized(model).items()}
    before = contract.snapshot(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=PRECISIONS[precision].autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    result = contract.check("qlora", model, before, optimizer=optimizer)
    assert result.passed, result.detail
    assert result.changed == TINY["num_hidden_layers"] * len(LINEARS) * 2
    assert all(torch.equal(p.quant_state.absmax, absmax[n]) for n, p in quantized(model).items())


def test_eval_forward_leaves_the_packed_bytes_alone(tiny_source):
    """bitsandbytes repacks 4-bit weights in place for eval-mode CPU forwards on AVX512-BF16
    machines; the build turns that off, or the contract would see the base change."""
    model = load(qlora_cfg(tiny_source, "precision=amp-bf16")).eval()
    before = contract.snapshot(model)
    with torch.no_grad():
        model(input_ids=torch.arange(16).view(1, 16))
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_pretrained_weights_quantize_exactly_as_transformers_does(tiny_source, tmp_path):
    """Loaded, then quantized: the packed codes and absmax equal transformers' own bitsandbytes
    loading of the same checkpoint, and dequantize to within NF4's error of the weights."""
    import transformers

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    reference.save_pretrained(tmp_path / "weights")
    model = load(qlora_cfg(tmp_path / "weights", "precision=amp-bf16"), seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "weights"),
        dtype=torch.bfloat16,
        device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
    )
    theirs = dict(hf.named_parameters())
    originals = dict(reference.named_parameters())
    ours = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in quantized(model).items()}
    assert sorted(ours) == sorted(quantized(hf))
    for name, p in ours.items():
        assert torch.equal(p.data, theirs[name].data), name
        assert torch.equal(p.quant_state.absmax, theirs[name].quant_state.absmax), name
        original = originals[name].detach().to(torch.bfloat16).float()
        restored = bnb.functional.dequantize_4bit(p.data, p.quant_state).float()
        assert (restored - original).abs().max() <= 0.2 * original.abs().max(), name  # NF4 steps <= 0.23


def test_4bit_bytes_match_the_plan_up_to_per_tensor_code_books(tiny_source):
    """Measured: 4-bit codes + absmax + the fixed code books per tensor; the analytic plan counts
    NF4_BYTES + NF4_CONSTANTS_BYTES per weight and leaves the code books out."""
    cfg = qlora_cfg(tiny_source, "precision=amp-bf16")
    model = load(cfg)
    fours = quantized(model).values()
    numel = sum(p.quant_state.shape.numel() for p in fours)
    packed = sum(p.numel() * p.element_size() for p in fours)
    states = [p.quant_state for p in fours]
    constants = sum(
        t.numel() * t.element_size()
        for s in states
        for t in (s.absmax, s.code, s.offset, s.state2.absmax, s.state2.code)
    )
    assert packed == numel * NF4_BYTES
    absmax = sum(s.absmax.numel() + 4 * s.state2.absmax.numel() for s in states)
    assert absmax == pytest.approx(numel * NF4_CONSTANTS_BYTES, abs=4 * len(states))  # ceil() per tensor
    assert constants == absmax + len(states) * PER_TENSOR_CONSTANTS
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dtype != torch.uint8)
    dense -= sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    planned = plan(cfg).devices[0].phases["forward"]["weights"]
    assert planned == int(numel * (NF4_BYTES + NF4_CONSTANTS_BYTES)) + dense
    gap = packed + constants + dense - planned
    assert 0 < gap <= len(states) * (PER_TENSOR_CONSTANTS + 4)


def test_qlora_is_refused_without_cuda_unless_tests_ask(tiny_source):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    cfg = qlora_cfg(tiny_source)
    spec = load_model_spec(cfg.model.source)
    with pytest.raises(TrainplanError, match=r"^run\.mode: qlora needs bitsandbytes on CUDA"):
        build.build_model(spec, cfg, PRECISIONS[cfg.precision])
    assert build.build_model(spec, cfg, PRECISIONS[cfg.precision], allow_cpu=True) is not None


def test_weights_that_would_stay_16_bit_are_refused(tmp_path):
    """GPT-2's Conv1D is not an nn.Linear: the plan counts its weights in NF4, the run could not."""
    source = tmp_path / "gpt2.json"
    source.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128, "vocab_size": 256}
        )
    )
    cfg = qlora_cfg(source, "lora.target_modules=['c_attn']")
    with pytest.raises(TrainplanError, match=r"^run\.mode: qlora quantizes nn\.Linear layers only, and transformer"):
        build.build_model(load_model_spec(cfg.model.source), cfg, PRECISIONS[cfg.precision], allow_cpu=True)


def test_qlora_under_fsdp_is_refused(tiny_source):
    # fully_shard turns each Params4bit into a plain DTensor, dropping its quant_state
    cfg = qlora_cfg(tiny_source, "parallel.strategy=zero3")
    spec = load_model_spec(cfg.model.source)
    dims = build_parallel_dims(cfg.parallel, 2, spec)
    with pytest.raises(TrainplanError, match=r"^run\.mode: qlora with parallel\.strategy = zero3"):
        build.build_model(spec, cfg, PRECISIONS[cfg.precision], dims=dims, allow_cpu=True)


@pytest.mark.multiprocess
def test_train_cli_refuses_qlora_on_the_cpu_in_one_line(tiny_source, tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    data = tmp_path / "data.txt"
    data.write_text("hello world\n" * 50)
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "trainplan", "train", "--model", str(tiny_source), "--data", str(data)]
        + ["--mode", "qlora", "--output-dir", str(out), "--registry", "off"],
        capture_output=True,
        text=True,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "run.mode: qlora needs CUDA GPUs" in lines[0] and not out.exists()


def test_a_qlora_run_records_the_bitsandbytes_version():
    import bitsandbytes

    assert record.versions("qlora")["bitsandbytes"] == bitsandbytes.__version__ == qlora.TESTED_BITSANDBYTES
    assert "bitsandbytes" not in record.versions("lora")


def test_the_installed_4bit_matmul_keeps_no_input_for_backward_as_planned():
    """The plan counts no 4-bit linear's input among the saved tensors. bitsandbytes before 0.43.2 kept
    it (`ctx.tensors = (A, B)`): LitGPT's published Llama-2 QLoRA points, measured on 0.41.1, sit 17-20 %
    above the plan until that term is added (bench/qlora_published.py). The installed library keeps
    only the packed weight, and an older one is refused with the fix."""
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4").to("cpu")
    x = torch.randn(4, 64, requires_grad=True)
    out = layer(x)
    kept = [t for t in out.grad_fn.tensors if t is not None]
    assert [t.dtype for t in kept] == [torch.uint8] and all(t.data_ptr() != x.data_ptr() for t in kept)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    qlora.check_version(bnb.__version__)
    qlora.check_version("0.43.2")
    with pytest.raises(TrainplanError, match=r"bitsandbytes 0\.41\.1.*pip install bitsandbytes==0\.50\.2"):
        qlora.check_version("0.41.1")
