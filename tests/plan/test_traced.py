"""The traced plan: fake tensors allocate exactly what real tensors do, and the analytic ledger
stays within a hair of the trace on tiny models (a drift test for every formula)."""

import json

import pytest

from trainplan import config as C
from trainplan import resolve
from trainplan.errors import TrainplanError
from trainplan.plan import analytic, fragmentation, traced, verdict

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # every test traces or runs the real model

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "vocab_size": 256,
    "attn_pdrop": 0.1,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
}

CASES = {
    "fp32": ["precision=fp32"],
    "amp-bf16": ["precision=amp-bf16"],
    "bf16": ["precision=bf16"],
    "lora-amp": ["precision=amp-bf16", "mode=lora"],
    "lora-qv-no-dropout": ["precision=fp32", "mode=lora", "lora.dropout=0"],  # q and v's lora_A share x
    "checkpointing": ["precision=fp32", "memory.activation_checkpointing=true"],
    # the first of the two layers (issue 20)
    "checkpointing-1-of-2": ["precision=fp32", "memory.activation_checkpointing=1"],
    "checkpointing-1-of-2-amp": ["precision=amp-bf16", "memory.activation_checkpointing=1"],
    # LoRA in fp32: under autocast this tiny model's plan is 2.5 KB (0.4 %) over, which SmolLM2's is not
    "checkpointing-1-of-2-lora": ["precision=fp32", "mode=lora", "memory.activation_checkpointing=1"],
    "eager": ["precision=fp32", "memory.attention=eager"],
    "inference": ["precision=amp-bf16", "mode=inference"],
    "accumulation": ["precision=fp32", "batch.grad_accum_steps=2"],
    "tied": ["precision=amp-bf16", "tied"],
    # SmolLM2's 49,152-token vocabulary: the embedding's backward (head and embedding gradients) is the peak
    "tied-vocab": ["precision=amp-bf16", "tied-vocab"],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_llama):
    d = tmp_path_factory.mktemp("models")
    (d / "tiny.json").write_text(json.dumps(tiny_llama))
    (d / "tied.json").write_text(json.dumps({**tiny_llama, "tie_word_embeddings": True}))
    (d / "tied-vocab.json").write_text(json.dumps({**tiny_llama, "tie_word_embeddings": True, "vocab_size": 49152}))
    (d / "gpt2.json").write_text(json.dumps(TINY_GPT2))
    return d


def cfg_for(tiny_dir, case: str, *extra: str):
    sets = [s for s in CASES[case] if not s.startswith("tied")]
    model = tiny_dir / next((f"{s}.json" for s in CASES[case] if s.startswith("tied")), "tiny.json")
    return C.load(
        None,
        [f"model.source={model}", "hardware.gpus=cpu", "batch.seq_len=32", "batch.micro_batch_size=2", *sets, *extra],
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_fake_trace_allocates_exactly_what_real_tensors_do(tiny_dir, case):
    cfg = cfg_for(tiny_dir, case)
    fake, _ = traced.trace(cfg)
    real, _ = traced.trace(cfg, real=True)
    assert {p: sum(c.values()) for p, c in fake.phases.items()} == {p: sum(c.values()) for p, c in real.phases.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_analytic_ledger_agrees_with_the_trace(tiny_dir, case):
    """Drift test: a change to transformers, torch or a formula that moves a term fails here."""
    cfg = cfg_for(tiny_dir, case)
    result, _ = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    for phase, comps in result.phases.items():
        diff = led.phase_total(phase) - sum(comps.values())
        # a few scalar tensors (loss, grad norm) are not modelled: tens of bytes
        assert abs(diff) <= 0.003 * result.peak_bytes, (phase, diff)


@pytest.mark.parametrize(
    "extra",
    [
        ["precision=fp32", "memory.activation_checkpointing=true"],
        ["precision=amp-bf16", "memory.activation_checkpointing=1"],
    ],
    ids=["every-layer-fp32", "1-of-2-amp"],
)
def test_selective_checkpointing_plan_agrees_with_the_trace(tiny_dir, extra):
    """memory.checkpointing_policy = "selective" (issue 20): a checkpointed layer keeps its matmul and
    attention outputs. Forward (what the layers keep) to the byte as the other cases; backward, where
    the recompute consumes the kept outputs, within 1 % of this tiny model's peak. (LoRA here is
    2 % under at backward; at SmolLM2 and Llama-3.2-1B sizes, LoRA's backward peak agrees within
    0.02 %: docs/memory-model.md.)"""
    cfg = cfg_for(tiny_dir, "fp32", *extra, "memory.checkpointing_policy=selective")
    result, _ = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    plain = analytic.plan(cfg_for(tiny_dir, "fp32", *extra)).devices[0]
    assert led.phase_total("forward") > plain.phase_total("forward")  # it keeps more than the input
    for phase, comps in result.phases.items():
        diff = led.phase_total(phase) - sum(comps.values())
        limit = 0.01 if phase == "backward" else 0.003
        assert abs(diff) <= limit * result.peak_bytes, (phase, diff)


def _backend_op(name: str, overload: str) -> bool:
    """An aten op that runs a kernel (no CompositeImplicitAutograd decomposition): a dispatch mode
    sees its outputs, never what the kernel allocates and frees inside it."""
    if not name.startswith("aten::"):
        return False
    try:
        qualified = f"{name}.{overload}" if overload else name
        return not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")
    except RuntimeError:  # no schema under that name: keep its allocations
        return False


def _profiled_peaks(cfg) -> dict[str, int]:
    """Peak bytes per phase from torch.profiler's allocator events, for the same real step, less
    kernel-internal temporaries: blocks allocated inside a kernel (an aten op with no
    CompositeImplicitAutograd decomposition) and freed before it returns. A dispatch mode sees op
    outputs only, and these depend on the CPU, not the model. Measured on torch 2.13: a bf16
    mm/addmm_ runs oneDNN's gemm:jit:bf16 on AVX512 without AVX512-BF16, whose scratchpad is an fp32
    (M, N) output plus 128 B; AVX512-BF16 and AMX run brgemm, 18-84 KB scratchpads not sized by
    M*N; AVX2 runs ATen's own bf16 gemm, none. Counted, they raise AVX512-without-BF16's forward
    peak by 128 B (the fused loss's 256x64 grad-weight addmm_ holds 65,664 B where the traced peak
    holds the 65,536 B fp32 logits chunk) and its backward peak by 8,320 B; AMX's backward by 1,792 B.
    """
    from torch._C._profiler import _EventType, _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    from trainplan.run import build, step

    r = resolve.resolve(cfg)
    torch.manual_seed(0)
    model = build.materialize(build.build_model(r.spec, cfg, r.precision), "cpu")
    opt = step.build_optimizer(model, "adamw", "auto", 1e-3, 0.0, "cpu")
    ids = torch.randint(0, r.spec.vocab_size, (2, 32))
    batch = [{"input_ids": ids, "labels": ids.clone()}]
    settings = step.StepSettings(prec=r.precision, device_type="cpu")
    step.train_step(model, step.Update(opt), batch, settings)  # warm-up: optimizer state
    base = sum(t.nbytes for t in [*model.parameters(), *model.buffers(), ids, batch[0]["labels"]])
    base += sum(t.nbytes for s in opt.state.values() for t in s.values())
    ranges = []

    def on_phase(name):
        if ranges:
            ranges[-1].__exit__(None, None, None)
        if name != "end":
            ranges.append(record_function(f"PHASE_{name}"))
            ranges[-1].__enter__()

    from trainplan import _torch_private as P

    overloads = _ExperimentalConfig(capture_overload_names=True)
    with (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True, experimental_config=overloads) as prof,
        P.unpacked_sequences(),
    ):
        step.train_step(model, step.Update(opt), batch, settings, hooks=step.StepHooks(on_phase=on_phase))
    spans, mem = [], []  # mem: (time, bytes, ptr, end of the outermost kernel op around the event)

    def walk(node, kernel_end):
        if node.tag == _EventType.TorchOp:
            if node.name.startswith("PHASE_"):
                spans.append((node.start_time_ns, node.end_time_ns, node.name[6:]))
            elif kernel_end is None and _backend_op(node.name, node.overload_name):
                kernel_end = node.end_time_ns
        elif node.tag == _EventType.Allocation:
            f = node.extra_fields
            mem.append((node.start_time_ns, f.alloc_size, f.ptr, kernel_end))
        for child in node.children:
            walk(child, kernel_end)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    mem.sort(key=lambda m: m[0])
    born, internal = {}, set()  # born: ptr -> index of the live block's allocation
    for i, (t, delta, ptr, _) in enumerate(mem):
        if delta > 0:
            born[ptr] = i
        elif ptr in born:
            j = born.pop(ptr)
            kernel_end = mem[j][3]
            if kernel_end is not None and t <= kernel_end:  # freed before its kernel returned
                internal |= {i, j}
    current, peaks = base, {}
    for i, (t, delta, _, _) in enumerate(mem):
        if i in internal:
            continue
        current += delta
        phase = next((n for s, e, n in spans if s <= t <= e), None)
        if phase:
            peaks[phase] = max(peaks.get(phase, 0), current)
    return peaks


@pytest.mark.parametrize("case", ["fp32", "amp-bf16", "lora-amp", "tied-vocab"])
def test_trace_matches_the_profilers_allocator_events(tiny_dir, case):
    """ "tied-vocab": autograd sums the head's and the embedding's gradients into the head's when no dispatch
    mode is active (the profiler's run), into a third tensor under one (the tracker); the tracker does
    the sum in place as the unmeasured run does, so the two agree."""
    cfg = cfg_for(tiny_dir, case)
    result, _ = traced.trace(cfg, real=True)
    profiled = _profiled_peaks(cfg)
    for phase, comps in result.phases.items():
        # the profiler also sees a handful of scalars the autograd engine allocates outside the
        # dispatcher (8-32 B here)
        diff = profiled[phase] - sum(comps.values())
        assert abs(diff) <= 64, (phase, diff)


def test_fsdp_trace_per_rank_with_a_fake_process_group(tiny_dir):
    cfg = C.load(
        None,
        [
            f"model.source={tiny_dir / 'tiny.json'}",
            "hardware.gpus=4xH100-80GB",
            "parallel.strategy=zero3",
            "batch.seq_len=32",
            "batch.micro_batch_size=2",
        ],
    )
    result, _ = traced.trace(cfg)
    single, _ = traced.trace(
        C.load(
            None,
            [
                f"model.source={tiny_dir / 'tiny.json'}",
                "hardware.gpus=H100-80GB",
                "batch.seq_len=32",
                "batch.micro_batch_size=2",
            ],
        )
    )
    # the optimizer state is sharded 4 ways (each tensor's dim 0 padded to a multiple of 4)
    assert result.phases["optimizer"]["optimizer"] == pytest.approx(
        single.phases["optimizer"]["optimizer"] / 4, rel=0.01
    )
    led = analytic.plan(cfg).devices[0]
    assert abs(led.peak_allocated - result.peak_bytes) <= 0.01 * result.peak_bytes
    assert result.world_size == 4


@pytest.mark.parametrize(
    "layout",
    [("cpu,cpu", "parallel.tp=2"), ("cpu,cpu,cpu,cpu", "parallel.tp=2", "parallel.strategy=zero3")],
    ids=["tp2", "dp2xtp2"],
)
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_tensor_parallel_trace_is_rank_0_and_agrees_with_the_plan(tiny_dir, layout, mode):
    """tp 2 and 2-D (FSDP2 over dp 2 x tp 2): rank 0 traced with its peers faked, its mesh the engine's,
    each phase within 0.1 % of the analytic ledger's rank 0 (which multi-process runs measure,
    tests/run/test_tensor_parallel.py); the trace says which rank it is."""
    gpus, *extra = layout
    lora = ["mode=lora", 'lora.target_modules=["all-linear"]'] if mode == "lora" else []
    model = f"model.source={tiny_dir / 'tied-vocab.json'}"
    cfg = C.load(None, [model, f"hardware.gpus={gpus}", "batch.seq_len=32", "batch.micro_batch_size=2", *extra, *lora])
    result, _ = traced.trace(cfg)
    dev = analytic.plan(cfg).devices[0]
    assert result.world_size == len(gpus.split(",")) and "rank 0 of" in result.notes[0]
    for phase in ("forward", "backward", "optimizer"):
        want = sum(dev.phases[phase].values())
        assert sum(result.phases[phase].values()) == pytest.approx(want, rel=0.001), phase


def test_ddp_and_zero_rows_are_derived_and_say_so(tiny_dir):
    cfg = C.load(
        None,
        [
            f"model.source={tiny_dir / 'tiny.json'}",
            "hardware.gpus=4xH100-80GB",
            "parallel.strategy=zero1",
            "batch.seq_len=32",
        ],
    )
    result, _ = traced.trace(cfg)
    assert result.rows["optimizer"].startswith("derived: zero1")
    assert any("derived" in n for n in result.notes)


def test_qlora_cannot_be_traced_and_says_why(tiny_dir):
    cfg = C.load(None, [f"model.source={tiny_dir / 'tiny.json'}", "hardware.gpus=H100-80GB", "mode=qlora"])
    with pytest.raises(TrainplanError, match="run.mode: qlora needs bitsandbytes"):
        traced.trace(cfg)


def test_fp32_inference_logits_are_not_upcast(tmp_path, tiny_llama):
    """In fp32, `logits.float()` is the same tensor: the loss moment holds logits and log-softmax
    only. (A vocabulary 16x the hidden size, as in real models, so the loss moment is the peak.)"""
    model = tmp_path / "wide.json"
    model.write_text(json.dumps({**tiny_llama, "vocab_size": 4096}))
    cfg = C.load(
        None,
        [f"model.source={model}", "hardware.gpus=cpu", "batch.seq_len=32", "batch.micro_batch_size=2"]
        + ["precision=fp32", "mode=inference"],
    )
    result, _ = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    assert abs(led.phase_total("inference") - result.peak_bytes) <= 0.003 * result.peak_bytes


def test_trace_labels_tensors_by_what_they_are(tiny_dir):
    """The optimizer updates parameters in place: they stay weights (not optimizer states), so
    each component of the trace, not only the totals, matches the ledger's."""
    cfg = cfg_for(tiny_dir, "fp32")
    result, _ = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    config = json.loads((tiny_dir / "tiny.json").read_text())
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config))
    params = sum(p.numel() * 4 for p in model.parameters())  # fp32
    step = result.phases["optimizer"]
    assert step["weights"] == params and step["gradients"] == params
    n_tensors = len(list(model.parameters()))  # Adam: two moments, and a 4-byte step count per tensor
    assert step["optimizer"] == led.phases["optimizer"]["optimizer"] == 2 * params + 4 * n_tensors


def _tiny_arch(tmp_path, preset: str, **extra) -> str:
    """A preset's architecture at toy size (the real transformers modules, every quirk kept)."""
    from trainplan.spec.model import preset_config

    config = {k: v for k, v in preset_config(preset).items() if not k.startswith("_")}
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config.update(num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, pad_token_id=None)
    config.update({k: v for k, v in {"head_dim": 16, "query_pre_attn_scalar": 16}.items() if k in config})
    config.update({"num_local_experts": 4} if "num_local_experts" in config else {})
    config.update(extra)
    path = tmp_path / f"{preset}.json"
    path.write_text(json.dumps(config))
    return str(path)


# (preset, settings, phases that must agree within 0.3%): each row is a term the analytic plan
# once missed on that architecture
ALL = ("forward", "backward", "optimizer")
ARCH_CASES = {
    "phi3-full": ("Phi-3-mini-4k", ["mode=full", "precision=fp32"], ("forward", "backward", "optimizer")),
    "phi3-full-amp": ("Phi-3-mini-4k", ["mode=full", "precision=amp-bf16"], ("forward", "optimizer")),
    "gemma2-lora-softcap": (
        "Gemma-2-9B",
        ["mode=lora", "precision=fp32", "memory.attention=eager"],
        ("forward", "backward", "optimizer"),
    ),
    "gemma2-full-softcap": (
        "Gemma-2-9B",
        ["mode=full", "precision=fp32", "memory.attention=eager"],
        ("forward", "backward", "optimizer"),
    ),
    "mixtral-full": ("Mixtral-8x7B", ["mode=full", "precision=bf16"], ALL),
    "mixtral-full-amp": ("Mixtral-8x7B", ["mode=full", "precision=amp-bf16"], ALL),
    "mixtral-lora": ("Mixtral-8x7B", ["mode=lora", "precision=bf16"], ALL),
    "mixtral-lora-amp": ("Mixtral-8x7B", ["mode=lora", "precision=amp-bf16"], ALL),
    # a small vocabulary: the final norm's backward is the backward peak (three fp32 temporaries under autocast)
    "llama-full-amp": ("tiny-llama", ["mode=full", "precision=amp-bf16"], ("forward", "backward", "optimizer")),
    # a vocabulary large beside the layers (SmolLM2's): the embedding's backward is the backward peak
    "big-vocab-tied": ("tiny-llama", ["mode=full", "precision=amp-bf16"], ("forward", "backward", "optimizer")),
    "big-vocab-untied": ("tiny-llama", ["mode=full", "precision=fp32"], ("forward", "backward", "optimizer")),
    "mixtral-full-checkpointing": (
        "Mixtral-8x7B",
        ["mode=full", "precision=bf16", "memory.activation_checkpointing=true"],
        ALL,
    ),
    # eager attention's 4-D masks live until the last checkpointed layer's backward (Gemma-2 builds two)
    "llama-full-eager-checkpointing": (
        "tiny-llama",
        ["mode=full", "precision=fp32", "memory.attention=eager", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    # LoRA with every layer checkpointed: forward's peak inside the top layer's forward (the vocabulary is
    # small), its recompute with the input requiring grad (transformers makes the embedding output
    # require it), the adapters' autocast copies of the recomputed layer only
    "llama-lora-checkpointing": (
        "tiny-llama",
        ["mode=lora", "precision=fp32", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    "llama-lora-amp-checkpointing": (
        "tiny-llama",
        ["mode=lora", "precision=amp-bf16", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    "llama-lora-eager-checkpointing": (
        "tiny-llama",
        ["mode=lora", "precision=fp32", "memory.attention=eager", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    # Gemma-2 with checkpointing: the post-feedforward norm's backward (five fp32 temporaries) is the
    # first layer's widest moment; the masks of a kind go with the last checkpoint keeping them
    "gemma2-full-softcap-checkpointing": (
        "Gemma-2-9B",
        ["mode=full", "precision=fp32", "memory.attention=eager", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    "gemma2-full-amp-checkpointing": (
        "Gemma-2-9B",
        ["mode=full", "precision=amp-bf16", "memory.attention=eager", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    "gemma2-lora-checkpointing": (
        "Gemma-2-9B",
        ["mode=lora", "precision=fp32", "memory.attention=eager", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
    "gemma2-lora-amp-checkpointing": (
        "Gemma-2-9B",
        ["mode=lora", "precision=amp-bf16", "memory.attention=eager", "memory.activation_checkpointing=true"],
        ("forward", "backward", "optimizer"),
    ),
}


def agrees_within_a_hair(cfg, phases) -> None:
    """The analytic ledger's phase totals within 0.3 % of the traced peak, phase by phase."""
    result, _ = traced.trace(cfg)
    led = analytic.plan(cfg).devices[0]
    for phase in phases:
        diff = led.phase_total(phase) - sum(result.phases[phase].values())
        assert abs(diff) <= 0.003 * result.peak_bytes, (phase, diff)


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_analytic_ledger_agrees_with_the_trace_per_architecture(tmp_path, case):
    preset, sets, phases = ARCH_CASES[case]
    vocab = {"vocab_size": 49152, "tie_word_embeddings": case.endswith("-tied")} if "big-vocab" in case else {}
    source = _tiny_arch(tmp_path, preset, **vocab)
    cfg = C.load(
        None,
        [f"model.source={source}", "model.init=random", "hardware.gpus=cpu", "batch.seq_len=32", *sets]
        + ["batch.micro_batch_size=2"],
    )
    agrees_within_a_hair(cfg, phases)


@pytest.mark.parametrize(
    ("gpus", "sets", "tied"),
    [
        ("cpu,cpu", ["mode=lora", "precision=fp32"], True),  # forward was planned 19 % low
        ("4xH100-80GB", ["mode=lora", "precision=bf16", "memory.activation_checkpointing=true"], False),  # 11 %
        ("4xH100-80GB", ["mode=full", "precision=fp32", "memory.activation_checkpointing=true"], False),  # 8 %
    ],
    ids=["lora-cpu-tied", "lora-bf16-checkpointing", "full-fp32-checkpointing"],
)
def test_fsdp2_forward_holds_the_root_unit_twice_as_the_first_layer_is_copied_out(tmp_path, gpus, sets, tied):
    """ZeRO-3 (FSDP2, resharding) with a vocabulary large beside a layer: FSDP2 keeps a unit's all-gather
    buffer until the next unit has copied out its own, so the first layer's copy-out holds the root
    unit twice (features/sharding/plan.py), and a checkpointed layer runs beside a second layer's
    buffer; each phase within 0.3 % of the trace, which equals the storage tracker on gloo ranks."""
    source = _tiny_arch(tmp_path, "tiny-llama", vocab_size=49152, tie_word_embeddings=tied)
    cfg = C.load(
        None,
        [f"model.source={source}", "model.init=random", f"hardware.gpus={gpus}", "parallel.strategy=zero3"]
        + ["batch.seq_len=32", "batch.micro_batch_size=1", *sets],
    )
    agrees_within_a_hair(cfg, ALL)


def test_fsdp_root_reduce_scatter_is_the_checkpointed_backward_peak(tmp_path):
    """FSDP2 reduce-scatters the root unit (embedding, head) after the whole backward, its unsharded
    gradients and their reduce-dtype copy alive together: with checkpointing and a vocabulary large
    beside the layers (Llama-3.1-8B's case, -2.04 % before), that is the backward peak."""
    source = _tiny_arch(tmp_path, "tiny-llama", vocab_size=49152)
    cfg = C.load(
        None,
        [f"model.source={source}", "model.init=random", "hardware.gpus=4xH100-80GB", "parallel.strategy=zero3"]
        + [
            "precision=amp-bf16",
            "memory.activation_checkpointing=true",
            "batch.seq_len=32",
            "batch.micro_batch_size=2",
        ],
    )
    agrees_within_a_hair(cfg, ("backward", "optimizer"))


def test_checkpointed_layers_keep_no_autocast_casts_into_backward(tmp_path):
    """autocast's cache is cleared when forward (and the loss) leave autocast; a checkpointed layer
    saved no cast, so backward starts with the head's casts only (Gemma-3-1B, +5.3 % before). Wide
    layers and the loss's logits make the start of backward the peak, the layers' casts 6 % of it."""
    wide = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 2048, "max_position_embeddings": 512}
    source = _tiny_arch(tmp_path, "tiny-llama", **wide)
    cfg = C.load(
        None,
        [f"model.source={source}", "model.init=random", "hardware.gpus=cpu", "mode=full", "precision=amp-bf16"]
        + ["train.fused_loss=false", "memory.activation_checkpointing=true", "batch.seq_len=256"]
        + ["batch.micro_batch_size=4"],
    )
    agrees_within_a_hair(cfg, ALL)


def test_an_fp32_moe_traces_as_it_runs(tmp_path):
    """torch's meta kernel for grouped matmuls takes bf16 only; the CPU and CUDA kernels take fp32
    too. The fake trace of an fp32 Mixtral allocates exactly what real tensors do."""
    source = _tiny_arch(tmp_path, "Mixtral-8x7B")
    cfg = C.load(
        None,
        [f"model.source={source}", "model.init=random", "hardware.gpus=cpu", "batch.seq_len=32"]
        + ["batch.micro_batch_size=2", "mode=full", "precision=fp32"],
    )
    fake, _ = traced.trace(cfg)
    real, _ = traced.trace(cfg, real=True)
    assert {p: sum(c.values()) for p, c in fake.phases.items()} == {p: sum(c.values()) for p, c in real.phases.items()}


def test_trace_explains_its_own_peak(tiny_dir, capsys):
    """`trainplan trace` says where its peak is and sets each traced component beside the
    analytic figure of the same phase, with the analytic term's reasoning."""
    from trainplan.cli import main

    args = ["trace", "--model", str(tiny_dir / "tiny.json"), "--gpus", "cpu", "--seq", "32", "--micro-batch", "2"]
    assert main([*args, "--precision", "fp32"]) == 0
    text = capsys.readouterr().out
    why = text.split("Why (", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert why[0].startswith("  backward: the most the fake tensors held at once during backward")
    lines = {line.split()[0]: line for line in why[1:] if not line.startswith("      ")}  # "weights 0.5 MiB: ..."
    assert {"weights", "gradients", "optimizer", "activations"} <= set(lines)
    assert "traced" in lines["weights"] and "B (fp32)" in lines["weights"]  # the analytic reasoning, kept


def test_a_gpu_trace_replays_its_allocations_through_the_caching_allocator(tiny_dir):
    """On a GPU the traced plan's reserve is the replay's (plan/allocator.py), not a fitted fraction:
    each measured phase's reserved peak, in both allocator modes, holds at least its tensors, and the
    ledger's margin says where it comes from."""
    from trainplan.plan import allocator

    cfg = C.load(None, [f"model.source={tiny_dir / 'tiny.json'}", "hardware.gpus=H100-80GB", "batch.seq_len=32"])
    result, r = traced.trace(cfg)
    assert set(result.reserved) == {"default", "expandable_segments"}
    workspace = cfg.hardware.cublas_workspace_mib << 20
    for mode, phases in result.reserved.items():
        assert set(phases) == set(result.phases), mode
        for phase, reserved in phases.items():
            assert reserved - workspace >= sum(result.phases[phase].values()), (mode, phase)
            # every segment (2 MiB, 20 MiB, or a large request rounded to 2 MiB) is a multiple of 2 MiB
            assert (reserved - workspace) % allocator.SMALL_BUFFER == 0, (mode, phase)
    ledger = traced.traced_ledger(result, r, analytic.plan(r.cfg, r.spec))
    d = ledger.devices[0]
    assert "replayed" in d.reserve_source and d.replayed_reserved
    top = max(result.reserved["expandable_segments"].values())  # the mode train runs
    miss, _ = fragmentation.replay_miss(cfg.mode, False)
    assert d.peak_allocated + d.reserve_bytes == pytest.approx(top - workspace + top * miss / (1 - miss), abs=1)


def test_a_replayed_reserve_keeps_the_replays_measured_miss_for_its_class(tiny_dir):
    """The replay under-predicted the one measured LoRA + checkpointing row with a long batch by 5.7%
    (docs/gpu-validation.md, row 13): a traced plan of that class keeps that much of its replayed
    reserved bytes on top, and its margin says so; a full fine-tune's rows were replayed to 0.01%."""
    base = [f"model.source={tiny_dir / 'tiny.json'}", "hardware.gpus=H100-80GB", "batch.seq_len=32"]
    figures = {}
    for mode in ("lora", "full"):
        cfg = C.load(None, [*base, f"mode={mode}", "memory.activation_checkpointing=true"])
        result, r = traced.trace(cfg)
        d = traced.traced_ledger(result, r, analytic.plan(r.cfg, r.spec)).devices[0]
        top = max(result.reserved["expandable_segments"].values())
        figures[mode] = (d.peak_allocated + d.reserve_bytes + (cfg.hardware.cublas_workspace_mib << 20)) / top - 1
        if mode == "lora":
            assert "Llama-3.2-3B lora amp-bf16 mb4 s4096 AC" in d.reserve_source, d.reserve_source
            assert "5.69%" in verdict.margin_text(d)
    assert figures["lora"] == pytest.approx(0.0569 / (1 - 0.0569), abs=1e-6)
    assert 0 < figures["full"] < 1e-3


@pytest.mark.parametrize("extra", [[], ["memory.activation_checkpointing=true"]], ids=["plain", "ac"])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_packed_documents_run_without_a_mask_and_are_planned_to_the_trace(mode, extra):
    """data.packing = "document": SDPA attends one document a call with no mask (run/attention.py), so the
    packed plan follows the trace (fake tensors through the engine's step, two documents a row) as closely as
    the concat plan does, with no (s x s) term: it sits above concat by less than one layer's mask would
    weigh (the position ids, the rotary tables per row and, under full fine-tuning, the assembled output)."""
    base = ["model.source=tiny-llama", "hardware.gpus=cpu", "batch.seq_len=256", "batch.micro_batch_size=2"]
    peaks, misses = {}, {}
    for kind in ("concat", "document"):
        cfg = C.load(None, [*base, "precision=fp32", f"mode={mode}", f"data.packing={kind}", *extra])
        result, r = traced.trace(cfg)
        d = analytic.plan(r.cfg, r.spec).devices[0]
        peaks[kind], misses[kind] = d.peak_allocated, d.peak_allocated / result.peak_bytes - 1
    # full fine-tuning with checkpointing plans concat 5.6 % over its trace (the recompute's moment), and
    # document packing the same; every other case within 0.1 %
    assert misses["document"] == pytest.approx(misses["concat"], abs=2e-3)
    assert abs(misses["document"]) < (0.06 if mode == "full" and extra else 1e-3)
    one_mask = 2 * 256 * 256 * 4  # (b, 1, s, s) fp32: what every layer saved with transformers' mask
    assert 0 < peaks["document"] - peaks["concat"] < one_mask


def test_the_plan_reads_the_packing_from_the_datas_first_row(tmp_path):
    from trainplan.run import sources

    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"instruction": "a", "output": "b"}\n')
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a b"}\n')
    data = lambda **kw: C.load(None, [f"data.{k}={v}" for k, v in kw.items()]).data  # noqa: E731
    assert sources.packing(data(source=str(chat))) == ("document", "chat.jsonl's rows are alpaca")
    assert sources.packing(data(source=str(text)))[0] == "concat"
    assert sources.packing(data(source="default"))[0] == "concat"
    assert sources.packing(data(source=str(chat), packing="concat")) == ("concat", "data.packing")


@pytest.mark.slow
def test_packed_documents_at_64k_tokens_measure_as_planned():
    """Issue 67, linear in s: tiny-llama on 65,536 tokens of packed documents (16 of 4,096 a row), a real step on
    this CPU (real tensors through the engine's step, every storage tracked): its peak is the plan's within 0.1 %
    (the issue asks 3 %); nothing of s x s exists to make it otherwise."""
    cfg = C.load(
        None,
        ["model.source=tiny-llama", "hardware.gpus=cpu", "precision=fp32", "batch.seq_len=65536"]
        + ["batch.micro_batch_size=1", "model.extend_context=true", "data.packing=document"],
    )
    result, r = traced.trace(cfg, real=True)
    d = analytic.plan(r.cfg, r.spec).devices[0]
    assert d.peak_allocated == pytest.approx(result.peak_bytes, rel=1e-3)
    assert result.peak_bytes < 65536 * 65536  # one (s x s) bool mask alone would be 4 GiB
