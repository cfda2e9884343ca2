"""The ledger's structure: every component where it belongs, per device, per phase."""

import json
from pathlib import Path

import pytest

from trainplan import config as C
from trainplan.errors import ConfigError, TrainplanError
from trainplan.plan.analytic import plan
from trainplan.spec.devices import GiB


def one(ledger):
    return ledger.devices[0]


def test_full_finetune_bill_has_every_training_component(make_cfg):
    led = one(plan(make_cfg(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB")))
    comps = led.phases["optimizer"]
    n = 1_235_814_400
    assert led.phases["forward"]["weights"] == 4 * n  # fp32 master weights under amp-bf16
    norms = (2 * 16 + 1) * 2048  # RMSNorm weights multiply in fp32: never cast
    head = 128256 * 2048  # the tied embedding/head: the fused loss casts it per call, not cached
    assert led.phases["forward"]["weight_copies"] == 2 * (n - norms - head)  # autocast's bf16 matmul weights
    unfused = one(plan(make_cfg(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB", train__fused_loss=False)))
    assert unfused.phases["forward"]["weight_copies"] == 2 * (n - norms)
    assert comps["gradients"] == 4 * n
    assert comps["optimizer"] == 8 * n  # AdamW m + v in fp32, step scalars on the host
    assert comps["optimizer_temp"] == 4 * n  # foreach sqrt(v) on CUDA
    assert led.phases["forward"]["gradients"] == 0  # set_to_none, single device, no accumulation
    assert led.peak_phase in ("forward", "backward", "optimizer")
    assert led.total_bytes == led.peak_allocated + led.runtime_bytes + led.reserve_bytes


def test_lora_keeps_base_weights_and_drops_their_gradients(make_cfg):
    full = one(plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="H100-80GB")))
    lora = one(plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="H100-80GB", mode="lora")))
    n = 8_030_261_248
    assert lora.phases["forward"]["weights"] == 2 * n  # frozen base in bf16, still in the bill
    assert lora.phases["optimizer"]["gradients"] == 0
    assert lora.phases["optimizer"]["optimizer"] == 0
    # q_proj (4096x4096) and v_proj (1024x4096) at r=8: 8*(4096+4096) + 8*(4096+1024) per layer.
    adapter_params = 32 * (8 * (4096 + 4096) + 8 * (4096 + 1024))
    assert lora.phases["forward"]["adapter"] == adapter_params * (4 + 8) + adapter_params * 2
    assert 0 < lora.phases["forward"]["activations"] < full.phases["forward"]["activations"]


def test_qlora_weights_are_nf4_plus_constants(make_cfg):
    lora = one(plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="H100-80GB", mode="lora")))
    qlora = one(plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="H100-80GB", mode="qlora")))
    embed_and_head, norms = 2 * 128256 * 4096, (2 * 32 + 1) * 4096
    linear = 8_030_261_248 - embed_and_head - norms
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + double-quantized absmax per 64-block
    assert qlora.phases["forward"]["weights"] == int(linear * nf4) + 2 * (embed_and_head + norms)
    assert qlora.phases["forward"]["weights"] < lora.phases["forward"]["weights"] / 2.5
    assert qlora.phases["forward"]["weight_copies"] == 14336 * 4096 * 2  # largest dequantized weight


def test_qlora_on_cpu_is_refused(make_cfg):
    with pytest.raises(ConfigError, match=r"run\.mode: qlora needs CUDA GPUs"):
        plan(make_cfg(mode="qlora", hardware__gpus="cpu"))


def test_inference_has_kv_cache_and_no_training_state(make_cfg):
    led = one(
        plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="H100-80GB", mode="inference", batch__seq_len=8192))
    )
    assert list(led.phases) == ["load", "inference"]
    comps = led.components
    assert comps["kv_cache"] == GiB
    assert comps["gradients"] == comps["optimizer"] == comps["optimizer_temp"] == 0
    assert comps["weights"] == 2 * 8_030_261_248


def test_the_ledger_covers_the_whole_run_in_order(make_cfg):
    led = one(plan(make_cfg(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB", mode="lora")))
    assert list(led.phases) == ["load", "forward", "backward", "optimizer", "evaluate", "save"]
    load = led.phases["load"]  # streamed from the file into the model: nothing beside it on one GPU
    assert load["weight_copies"] == 0 and load["weights"] == led.phases["forward"]["weights"]
    assert load["adapter"] > 0 and "gradients" not in load


def test_evaluation_costs_no_more_than_the_step_under_the_chunked_loss(make_cfg):
    """128k vocabulary x 4096 tokens: full logits would be 5.9 GiB in fp32 alone; evaluation goes
    through the same chunked head as training (run/evaluate.py)."""
    led = one(
        plan(
            make_cfg(
                model__source="Llama-3.2-1B",
                hardware__gpus="H100-80GB",
                mode="lora",
                batch__seq_len=4096,
                memory__activation_checkpointing=True,
            )
        )
    )
    assert led.phase_total("evaluate") < led.phase_total("backward")
    assert led.phases["evaluate"]["logits_loss"] < 4096 * 128_256 * 4 / 4


def test_saving_under_fsdp_gathers_full_tensors_and_rank_0_keeps_them_on_cpu(make_cfg):
    cfg = make_cfg(model__source="Llama-3.2-1B", hardware__gpus="2xcpu", mode="full", parallel__strategy="zero3")
    led = plan(cfg)
    first, second = (d.phases["save"]["weight_copies"] for d in led.devices)
    embedding = 128_256 * 2048 * 4  # the largest tensor, fp32 master weights
    full = 1_235_814_400 * 4
    assert second == 3 * embedding  # gathered one at a time: 3 buffers of it at once
    assert first == full + 3 * embedding  # the main CPU rank keeps what it gathered for the file
    ddp_cfg = make_cfg(model__source="Llama-3.2-1B", hardware__gpus="2xcpu", mode="full", parallel__strategy="ddp")
    ddp = one(plan(ddp_cfg))
    assert ddp.phases["save"]["weight_copies"] == 0
    assert ddp.phases["save"]["gradients"] == full  # DDP's buckets outlive zero_grad


def test_the_verdict_names_the_phase_where_the_run_peaks(make_cfg):
    cfg = make_cfg(
        model__source="GPT-2",
        batch__seq_len=1024,
        parallel__pp=12,
        parallel__strategy="zero3",
        hardware__gpus="24xT4",
        precision="amp-fp16",
    )
    led = plan(cfg)
    assert one(led).peak_phase == "save"  # the first stage gathers the 50257 x 768 embedding
    assert "at the save peak" in led.verdict()


def test_activations_scale_with_batch_and_seq(make_cfg):
    def layer(**kw):
        led = one(plan(make_cfg(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB", **kw)))
        return sum(b for _, b in led.details["activations (one layer)"])

    base = layer(batch__micro_batch_size=1, batch__seq_len=1024)
    assert layer(batch__micro_batch_size=4, batch__seq_len=1024) == 4 * base  # SDPA: linear in tokens
    assert layer(batch__micro_batch_size=1, batch__seq_len=2048) == 2 * base
    eager1 = layer(batch__seq_len=1024, memory__attention="eager")
    eager2 = layer(batch__seq_len=2048, memory__attention="eager")
    assert eager2 > 2 * eager1  # the s^2 scores


def test_checkpointing_keeps_only_layer_inputs(make_cfg):
    kw = dict(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB", batch__seq_len=2048)
    off = one(plan(make_cfg(**kw)))
    on = one(plan(make_cfg(**kw, memory__activation_checkpointing=True)))
    t, h, head_dim = 2048, 2048, 64
    assert on.phases["forward"]["activations"] < off.phases["forward"]["activations"] / 4
    layer_inputs = 16 * t * h * 4  # one fp32 residual-stream tensor per layer
    final_norm = 4 * t * h + 4 * t + 4 * t * h  # its fp32 input, rsqrt, normalized tensor
    final_hidden = 4 * t * h  # referenced by the model during the loss (the fused loss saves no head input)
    batch_and_rotary = 2 * t * 8 + 2 * t * head_dim * 4  # ids, labels; cos and sin
    assert on.phases["forward"]["activations"] == layer_inputs + final_norm + final_hidden + batch_and_rotary
    unfused = one(plan(make_cfg(**kw, memory__activation_checkpointing=True, train__fused_loss=False)))
    lm_head_input = 2 * t * h  # autocast's bf16 copy, saved for the head's weight gradient
    assert unfused.phases["forward"]["activations"] == on.phases["forward"]["activations"] + lm_head_input


def test_zero_stages_shard_what_they_shard(make_cfg):
    def led(strategy):
        return one(
            plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="8xH100-80GB", parallel__strategy=strategy))
        )

    ddp, z1, z2, z3 = led("ddp"), led("zero1"), led("zero2"), led("zero3")
    opt = ddp.phases["optimizer"]
    assert z1.phases["optimizer"]["optimizer"] == pytest.approx(opt["optimizer"] / 8, rel=1e-3)
    assert z1.phases["optimizer"]["gradients"] == opt["gradients"]
    assert z2.phases["optimizer"]["gradients"] == pytest.approx(opt["gradients"] / 8, rel=1e-3)
    assert z2.phases["optimizer"]["weights"] == opt["weights"]
    assert z3.phases["optimizer"]["weights"] == pytest.approx(opt["weights"] / 8, rel=1e-3)
    # ZeRO-3 model states in torch's AMP form: (4 + 4 + 8) bytes / N.
    states = sum(z3.phases["optimizer"][c] for c in ("weights", "gradients", "optimizer"))
    assert states == pytest.approx(16 * 8_030_261_248 / 8, rel=1e-3)
    assert ddp.phases["forward"]["gradients"] == opt["gradients"]  # DDP buckets persist


def test_gradient_accumulation_keeps_gradients_live_in_forward(make_cfg):
    led = one(plan(make_cfg(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB", batch__grad_accum_steps=4)))
    assert led.phases["forward"]["gradients"] == led.phases["optimizer"]["gradients"]


def test_memory_never_pools_across_devices(make_cfg):
    ledger = plan(
        make_cfg(model__source="Llama-3.1-8B", mode="lora", hardware__gpus="A100-80GB,RTX4090", batch__seq_len=2048)
    )
    a100, rtx = ledger.devices
    assert a100.fits and not rtx.fits
    assert not ledger.fits and ledger.exit_code == 1
    text = ledger.verdict()
    assert "GPU 1 (RTX4090" in text and "memory does not pool" in text
    assert "weights" in text or "activations" in text


def test_pipeline_stages_are_unequal(make_cfg):
    ledger = plan(
        make_cfg(model__source="Llama-3.1-8B", hardware__gpus="4xH100-80GB", parallel__pp=4, batch__grad_accum_steps=8)
    )
    first, last = ledger.devices[0], ledger.devices[-1]
    assert first.phases["forward"]["logits_loss"] == 0 and last.phases["forward"]["logits_loss"] > 0
    # 1F1B: stage 0 holds 4 micro-batches in flight, the last stage 1.
    assert (
        first.phases["forward"]["activations"]
        > 3 * last.phases["forward"]["activations"] - last.phases["forward"]["activations"]
    )
    assert first.phases["forward"]["weights"] != last.phases["forward"]["weights"]


def test_tensor_parallel_divides_weights(make_cfg):
    tp1 = one(plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="H100-80GB")))
    tp4 = one(plan(make_cfg(model__source="Llama-3.1-8B", hardware__gpus="4xH100-80GB", parallel__tp=4)))
    norms = (2 * 32 + 1) * 4096 * 4  # replicated
    assert tp4.phases["forward"]["weights"] == pytest.approx((tp1.phases["forward"]["weights"] - norms) / 4 + norms)


def test_offload_puts_optimizer_on_a_host_row(make_cfg):
    ledger = plan(
        make_cfg(
            model__source="Llama-3.1-8B",
            hardware__gpus="2xH100-80GB",
            parallel__offload_optimizer=True,
            hardware__host_mem="1TiB",
        )
    )
    assert ledger.host is not None
    assert ledger.devices[0].phases["optimizer"]["optimizer"] == 0
    assert ledger.host.peak_allocated > 2 * 8 * 8_030_261_248  # both ranks' Adam states
    assert "host" in [c for c in ledger.to_json()] or ledger.to_json()["host"]["label"] == "host"


def test_fsdp2_offload_keeps_shards_gradients_and_the_step_on_the_host(make_cfg):
    """FSDP2's CPUOffloadPolicy (the engine's offload): the device holds no parameter shard, gradient
    or optimizer state in any phase, only what is gathered or computed (in backward, the head's
    gradient before the root unit's reduce-scatter); the host holds every rank's shards, gradients,
    states and the step's temporaries (the CPU's for-loop implementation)."""
    settings = {"model__source": "Llama-3.1-8B", "hardware__gpus": "4xH100-80GB", "parallel__strategy": "zero3"}
    plain = plan(make_cfg(**settings))
    ledger = plan(make_cfg(**settings, parallel__offload_optimizer=True, hardware__host_mem="1TiB"))
    dev, before = ledger.devices[0], plain.devices[0]
    for phase, comps in dev.phases.items():
        assert [comps.get(c, 0) for c in ("weights", "optimizer", "optimizer_temp")] == [0] * 3, phase
        assert comps.get("gradients", 0) == 0 or phase == "backward", phase
    # the head's: Llama-3.1-8B's untied lm_head gradient, whole and in bf16, until the root unit's reduce-scatter
    assert dev.phases["backward"]["gradients"] == 128_256 * 4096 * 2
    shard = before.phases["forward"]["weights"]  # this rank's fp32 parameter shard
    assert dev.phases["forward"]["weight_copies"] > before.phases["forward"]["weight_copies"]  # + a unit's shard
    assert dev.peak_allocated < before.peak_allocated - shard  # the device gave up at least the weights
    host = ledger.host
    assert "FSDP2 CPUOffloadPolicy" in host.explain["optimizer"]
    per_rank = before.phases["optimizer"]
    adam = per_rank["weights"] + per_rank["gradients"] + per_rank["optimizer"]
    assert host.peak_allocated > 4 * adam  # every rank's shards, gradients and states, plus the step
    assert host.peak_allocated < 4 * (adam + per_rank["optimizer_temp"])  # for-loop temporaries, not foreach's
    # page-locked: each padded parameter shard and each gradient shard (fp32, a quarter of dim 0 each) is
    # rounded up to a power of two by CUDA's caching host allocator
    from trainplan.plan import context
    from trainplan.plan import terms as T
    from trainplan.resolve import resolve

    r = resolve(make_cfg(**settings, parallel__offload_optimizer=True, hardware__host_mem="1TiB"))
    shards = [-(-t.shape[0] // 4) * (t.numel // t.shape[0]) * 4 for t in r.spec.tensors]
    pinned = sum(1 << (n - 1).bit_length() for n in shards)
    assert T.pinned_fsdp_shards(context.rank_context(r, 0)) == (pinned, pinned)
    assert pinned > sum(shards) and "power of two" in host.explain["optimizer"]
    states_and_step = host.peak_allocated // 4 - 2 * pinned
    assert per_rank["optimizer"] < states_and_step < per_rank["optimizer"] + per_rank["optimizer_temp"]
    assert "this rank's shard is in host memory" in dev.explain["weights"]


def test_fsdp2_offload_on_a_gpu_covers_what_the_measured_row_held_outside_every_tensor(make_cfg):
    """The one GPU row of FSDP2's optimizer offload (the 2026-12-04 H200 run, row 25) held 14.9e9 B of
    allocated device memory no tensor owned: the plan carries it as runtime, scaled to each rank's
    stored shard, so its device total covers the measured reserved bytes (it was 32% under them).
    The trace, which cannot tell host from device tensors, refuses the layout."""
    from trainplan.features import optimizer_offload
    from trainplan.plan import context
    from trainplan.plan import terms as T
    from trainplan.resolve import resolve

    recorded = Path(__file__).parents[2] / "docs/data/gpu-validate-h200-2026-12-04.json"
    (row,) = [r for r in json.loads(recorded.read_text())["rows"] if "offload_optimizer=true" in r["name"]]
    cfg = C.load(None, row["settings"], {})
    dev = one(plan(cfg))
    measured = row["measured"]
    assert dev.peak_allocated + dev.runtime_bytes >= measured["peak_allocated_bytes"]
    assert measured["peak_reserved_bytes"] <= dev.total_bytes <= 1.05 * measured["peak_reserved_bytes"]
    assert "not yet explained" in dev.explain["runtime"]
    r = resolve(cfg)
    assert "cannot tell the host's parameter shards" in optimizer_offload.untraceable(r)
    # on two ranks, each holds its half; without offload, nothing of it
    half = resolve(C.load(None, [*row["settings"], 'hardware.gpus="2xH200-141GB"'], {}))
    whole = T.offload_untracked(context.rank_context(r, 0))
    assert T.offload_untracked(context.rank_context(half, 0)) == pytest.approx(whole / 2, rel=1e-3)
    plain = resolve(C.load(None, [*row["settings"], "parallel.offload_optimizer=false"], {}))
    assert T.offload_untracked(context.rank_context(plain, 0)) == 0


def test_offload_on_the_cpu_runs_through_fsdp2_and_moves_nothing(make_cfg):
    """On the CPU the host is the device: FSDP2's offload plans as zero3 does, with no host column;
    any other strategy with offload is refused there, and for `train` on GPUs (only FSDP2's runs)."""
    from trainplan.resolve import NotRunnable, require_runnable, resolve

    settings = {"model__source": "tiny-llama", "hardware__gpus": "2xcpu", "parallel__strategy": "zero3"}
    plain, offloaded = plan(make_cfg(**settings)), plan(make_cfg(**settings, parallel__offload_optimizer=True))
    assert offloaded.host is None
    assert [d.phases for d in offloaded.devices] == [d.phases for d in plain.devices]
    assert "on the CPU the host is the device" in offloaded.devices[0].explain["optimizer"]
    with pytest.raises(ConfigError, match=r"parallel\.offload_optimizer: on the CPU only FSDP2's offload runs"):
        plan(make_cfg(**{**settings, "parallel__strategy": "ddp"}, parallel__offload_optimizer=True))
    with pytest.raises(ConfigError, match=r"parallel\.offload_optimizer: inference has no optimizer"):
        plan(make_cfg(**settings, mode="inference", parallel__offload_optimizer=True))
    r = resolve(make_cfg(model__source="tiny-llama", hardware__gpus="2xA100-80GB", parallel__offload_optimizer=True))
    with pytest.raises(NotRunnable, match=r"offload is planned as DeepSpeed's ZeRO-Offload but not run"):
        require_runnable(r.cfg, r.dims, cuda=True)


def test_activation_offload_moves_the_saved_layers_to_the_host(make_cfg):
    """memory.offload_activations on a GPU: the layers not checkpointed keep one layer's saved tensors on
    the device (forming in forward, back for backward); the rest is the host column's activations,
    rounded up per tensor to a power of two in page-locked buffers. The head and the loss stay."""
    from trainplan.plan import context
    from trainplan.plan import terms as T
    from trainplan.resolve import resolve

    settings = {
        "model__source": "Llama-3.1-8B",
        "mode": "lora",
        "hardware__gpus": "H100-80GB",
        "hardware__host_mem": "1TiB",
    }
    settings |= {"batch__seq_len": 4096, "batch__micro_batch_size": 2}
    plain = plan(make_cfg(**settings))
    moved = plan(make_cfg(**settings, memory__offload_activations=True))
    pinned = plan(make_cfg(**settings, memory__offload_activations="pinned"))
    half = plan(make_cfg(**settings, memory__offload_activations=True, memory__activation_checkpointing=16))
    ctx = context.rank_context(resolve(make_cfg(**settings)), 0)
    layer, first = T._layer_saved_bytes(ctx), T._layer_saved_bytes(ctx, input_requires_grad=False)
    dev = moved.devices[0]
    # 32 layers, the first one's input needing no gradient under LoRA
    assert dev.offloaded_activation_bytes == 31 * layer + first == dev.host_activation_bytes
    assert moved.host.phases["forward"] == {"activations": dev.host_activation_bytes}
    saved = plain.devices[0].phases["forward"]["activations"] - dev.phases["forward"]["activations"]
    # the forward peak is the top layer forming: its saved tensors on the device, the head's not yet there
    head = sum(t.nbytes for t in T.activations(ctx).head_saved)
    assert saved == 30 * layer + first + head
    assert dev.phases["forward"]["logits_loss"] == 0
    assert dev.peak_allocated < plain.devices[0].peak_allocated - 25 * 2**30
    assert pinned.devices[0].phases == dev.phases
    assert dev.host_activation_bytes < pinned.host.peak_allocated < 2 * dev.host_activation_bytes
    # checkpointing the first 16 layers: their inputs go to the host too (checkpoints in host memory, issue 67),
    # with the other 16 layers' saved tensors; each comes back for its layer's recompute
    layer_in = T.activations(ctx).layer_in
    assert half.devices[0].offloaded_activation_bytes == 16 * layer + 16 * layer_in
    every = plan(make_cfg(**settings, memory__offload_activations=True, memory__activation_checkpointing=True))
    assert every.devices[0].offloaded_activation_bytes == 32 * layer_in == every.devices[0].host_activation_bytes
    kept = plan(make_cfg(**settings, memory__activation_checkpointing=True)).devices[0].phases["forward"]
    assert kept["activations"] - every.devices[0].phases["forward"]["activations"] >= 31 * layer_in
    assert (
        "offloaded activations" in moved.host.role and "memory.offload_activations" in moved.host.explain["activations"]
    )


def test_activation_offload_on_the_cpu_moves_nothing_and_is_refused_where_it_has_nothing_to_do(make_cfg):
    from trainplan.plan.traced import trace

    settings = {"model__source": "tiny-llama", "hardware__gpus": "cpu"}
    plain, moved = plan(make_cfg(**settings)), plan(make_cfg(**settings, memory__offload_activations=True))
    assert moved.host is None and [d.phases for d in moved.devices] == [d.phases for d in plain.devices]
    assert moved.devices[0].offloaded_activation_bytes > 0  # the hooks' bytes, which stay
    assert "the host being the device" in moved.devices[0].explain["activations"]
    with pytest.raises(ConfigError, match=r"memory\.offload_activations: inference saves no activations"):
        plan(make_cfg(**settings, mode="inference", memory__offload_activations=True))
    every = plan(make_cfg(**settings, memory__offload_activations=True, memory__activation_checkpointing=True))
    assert every.devices[0].offloaded_activation_bytes > 0  # the checkpoints' inputs: they pass, and stay
    with pytest.raises(ConfigError, match=r"memory\.offload_activations: unknown value 'yes'.*\"pinned\""):
        make_cfg(**settings, memory__offload_activations="yes")
    with pytest.raises(ConfigError, match=r"train\.compile: a compiled layer saves other tensors"):
        plan(make_cfg(**settings, memory__offload_activations=True, train__compile=True))
    from trainplan.features import torch_compile
    from trainplan.resolve import resolve

    gpu = {"model__source": "tiny-llama", "hardware__gpus": "H100-80GB", "train__compile": "auto"}
    active = torch_compile.active
    assert active(resolve(make_cfg(**gpu))) and not active(resolve(make_cfg(**gpu, memory__offload_activations=True)))
    with pytest.raises(TrainplanError, match=r"memory\.offload_activations: the trace runs on one fake device"):
        trace(make_cfg(model__source="tiny-llama", hardware__gpus="H100-80GB", memory__offload_activations=True))


def test_bf16_on_v100_is_refused_with_the_fix(make_cfg):
    with pytest.raises(
        ConfigError, match=r'run\.precision: amp-bf16 needs bf16, which T4 lacks; use precision = "amp-fp16"'
    ):
        plan(make_cfg(hardware__gpus="T4", precision="amp-bf16"))
    assert plan(make_cfg(hardware__gpus="T4", precision="amp-fp16")).devices[0].device.name == "T4"
    assert plan(make_cfg(hardware__gpus="T4", precision="auto")).settings["precision"] == "amp-fp16"


def test_lora_target_that_matches_nothing(make_cfg):
    phi3 = {"model__source": "Phi-3-mini-4k", "mode": "lora", "hardware__gpus": "H100-80GB"}
    with pytest.raises(ConfigError, match=r"lora\.target_modules: 'q_proj' matches no linear layer of microsoft/Phi-3"):
        plan(make_cfg(**phi3, lora__target_modules=["q_proj"]))
    assert plan(make_cfg(**phi3)).settings["lora"]["target_modules"] == ["qkv_proj"]  # the default, "attention"


def test_optimizer_choices_change_the_states(make_cfg):
    def opt(name):
        return one(plan(make_cfg(model__source="Llama-3.2-1B", hardware__gpus="H100-80GB", optim__name=name))).phases[
            "optimizer"
        ]["optimizer"]

    n = 1_235_814_400
    assert opt("sgd") == 0
    assert opt("sgd-momentum") == 4 * n
    assert opt("adamw-8bit") == pytest.approx(2 * n, rel=0.02)
    assert opt("adafactor") < n / 100  # factored second moment only


def test_the_verdict_keeps_the_plans_known_error_free_and_says_so():
    """A bill that fits only without the architecture's error band does not fit, and the verdict
    names the margin and where it comes from (bench/trace_accuracy.py's rows)."""
    import dataclasses

    from trainplan import config as C
    from trainplan.plan import accuracy

    cfg = C.load(None, ["model.source=Llama-3.1-8B", "mode=lora", "hardware.gpus=H100-80GB"])
    led = plan(cfg)
    dev = led.devices[0]
    band, source = accuracy.band("llama", "lora", derived=False)
    assert dev.error_band == band > 0 and "llama lora rows" in source
    assert dev.headroom_bytes == dev.usable_bytes - dev.total_bytes - dev.error_margin_bytes
    assert "margin" in led.verdict() and f"{band:.2%}" in led.verdict()
    # capacity between the bill and the bill plus its margin: fits only if the margin is ignored
    capacity = int((dev.total_bytes + dev.error_margin_bytes // 2) / (1 - dev.safety_margin)) + 1
    tight = dataclasses.replace(dev, device=dataclasses.replace(dev.device, capacity_bytes=capacity))
    assert tight.usable_bytes >= tight.total_bytes and not tight.fits
    assert accuracy.band("a-new-type", "full", derived=True)[0] >= accuracy.DERIVED_MIN_BAND


def test_the_accuracy_band_is_kept_per_architecture_and_mode(tmp_path, monkeypatch):
    """bench/trace_accuracy.py --bands writes each architecture's worst under-prediction per mode; the
    verdict looks it up by both. A mode without rows takes the widest of the architecture's other modes
    and of that mode elsewhere; a derived architecture the widest band, at least DERIVED_MIN_BAND."""
    import json

    from trainplan import config as C
    from trainplan.plan import accuracy

    bands = {"llama": {"full": 0.0, "lora": 0.002}, "qwen2": {"full": 0.001, "qlora": 0.004}}
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps({"source": "a test table", "bands": bands}))
    monkeypatch.setattr(accuracy, "BANDS_FILE", path)
    accuracy._bands.cache_clear()
    try:
        assert accuracy.band("llama", "full", derived=False) == (0.0, "")
        assert accuracy.band("llama", "lora", derived=False)[0] == 0.002
        # no llama qlora rows: the widest of llama's modes (0.002) and of qlora elsewhere (0.004)
        value, why = accuracy.band("llama", "qlora", derived=False)
        assert value == 0.004 and "no llama qlora rows" in why
        assert accuracy.band("qwen2", "inference", derived=False)[0] == 0.004
        assert accuracy.band("gemma2", "full", derived=False)[0] == accuracy.DERIVED_MIN_BAND
        assert accuracy.band("llama", "full", derived=True)[0] == accuracy.DERIVED_MIN_BAND
        # the verdict takes the mode's band: a Llama LoRA plan keeps 0.2% of its peak, a full one nothing
        for mode, want in (("lora", 0.002), ("full", 0.0)):
            cfg = C.load(None, ["model.source=Llama-3.2-1B", f"mode={mode}", "hardware.gpus=H100-80GB"])
            assert plan(cfg).devices[0].error_band == want
    finally:
        accuracy._bands.cache_clear()


def test_qlora_plans_meet_the_published_points_once_the_stacks_bitsandbytes_is_counted(bench_script):
    """LitGPT's Llama-2 7B / 13B points (bench/qlora_published.py): the 16-bit LoRA rows within 3 % of
    the plan; the 4-bit rows 16-21 % above it, and within 7 % once bitsandbytes 0.41's kept matmul
    inputs (and the absmax of the rows without double quantization) are added. Without those terms the
    4-bit rows miss: the gap is the stack's, not a term the pinned engine holds."""
    for row in bench_script("qlora_published").rows():
        published, planned = row["published"], row["plan"]
        if row["mode"] == "lora":
            assert row["stack"] == 0 and abs(planned - published) <= 0.03 * published, row
        else:
            assert 0.16 * published <= published - planned <= 0.21 * published, row
            assert abs(planned + row["stack"] - published) <= 0.07 * published, row


def _activations(*sets: str) -> int:
    base = ["model.source=tiny-llama", "hardware.gpus=cpu", "precision=fp32", "model.extend_context=true"]
    d = plan(C.load(None, [*base, *sets])).devices[0]
    return d.phases["backward"]["activations"]


def test_packed_documents_activations_grow_linearly_with_the_sequence():
    """Issue 67: with no (s x s) mask, a packed plan's activations at 32K tokens are at most 2.1x those at 16K
    (the plan had a (b, 1, s, s) mask term in every layer, 4x); eager attention's scores stay quadratic."""
    packed = {s: _activations("data.packing=document", f"batch.seq_len={s}") for s in (16384, 32768)}
    assert packed[32768] <= 2.1 * packed[16384]
    eager = {s: _activations("memory.attention=eager", f"batch.seq_len={s}") for s in (16384, 32768)}
    assert eager[32768] > 3.5 * eager[16384]


def test_context_parallelism_plans_each_rank_a_slice_of_the_sequence():
    """cp 2 on 2 ranks: each rank's activations are those of half the sequence on one process, plus what the
    split adds: the all-to-all's output, a new tensor the output projection saves (2 layers x 2048 tokens x 64
    x 4 B), and the step's whole ids and labels, the positions and the rank's shifted labels (int64)."""
    half = _activations("batch.seq_len=2048")
    sets = ["model.source=tiny-llama", "hardware.gpus=2xcpu", "precision=fp32", "batch.seq_len=4096"]
    split = plan(C.load(None, [*sets, "parallel.cp=2"]))
    exchanged = 2 * 2048 * 64 * 4
    inputs = (2 * 4096 + 4096 + 2048 - 2 * 2048) * 8
    assert len(split.devices) == 2
    for d in split.devices:
        assert d.phases["backward"]["activations"] == half + exchanged + inputs
