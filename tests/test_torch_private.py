"""The adapter around private torch/transformers internals: version range, tracker accounting."""

import re

import pytest

torch = pytest.importorskip("torch")

from trainplan import _torch_private as P  # noqa: E402
from trainplan.errors import TrainplanError  # noqa: E402


def test_installed_torch_is_in_the_tested_range():
    P.check_torch_version()  # raises outside TESTED_TORCH


def test_the_torch_range_is_stated_once():
    """pyproject's `run` extra declares TESTED_TORCH's bounds, and requirements.txt pins a version inside."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["run"]
    (spec,) = [d for d in extra if re.match(r"torch\b", d)]
    (low, high) = P.TESTED_TORCH
    assert spec == f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"
    (pin,) = re.findall(r"^torch==(\S+)$", (root / "requirements.txt").read_text(), re.M)
    P.check_torch_version(pin)  # the pinned version is inside the range


@pytest.mark.parametrize("version", ["2.7.1", "3.0.0", "1.13.1+cu117"])
def test_versions_outside_the_range_fail_loudly(version):
    with pytest.raises(TrainplanError, match=f"torch {re.escape(version)} is outside the range"):
        P.check_torch_version(version)


def test_tracker_counts_storages_from_creation_to_release():
    tracker = P.StorageTracker()
    with tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float16)  # 1000 bytes
        view = a[:10]  # a view allocates nothing
        assert tracker.total == 5000
        del a, view
        assert tracker.total == 1000
        del b
    assert tracker.total == 0 and tracker.peak_total == 5000


def test_a_gpu_meter_leaves_host_storages_to_the_host():
    """A GPU's tracker counts its own device's storages: offloaded states and activations live in host
    memory, whose bytes are the host column's. Here the host's tensors pass uncounted, the CPU's own
    meter (no device given) counts them."""
    gpu, cpu = P.StorageTracker(device=torch.device("cuda", 0)), P.StorageTracker()
    with gpu, cpu:
        host = torch.empty(1000)
        assert gpu.total == 0 and cpu.total == 4000
        del host


def test_a_tracked_model_is_freed_once_the_caller_drops_it():
    """The finalizers outlive the step (they are global): they must not keep the model alive. On the
    GPU this leaked every measured model into the next one's allocator figures."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = P.StorageTracker()
    tracker.track(model, optimizer, [])
    with tracker:
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    weight = weakref.ref(model[0].weight)
    del model, optimizer, tracker
    gc.collect()
    assert weight() is None


def test_tracker_follows_storage_resize_like_fsdp_does():
    tracker = P.StorageTracker()
    with tracker:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)
        assert tracker.total == 0
        t.untyped_storage().resize_(2048)
        assert tracker.total == 2048
    assert torch.UntypedStorage.resize_ is tracker._orig_resize  # restored


def _live_bytes(events: list[tuple]) -> tuple[int, int]:
    """(bytes live at the end, the most live at once) of an allocation stream."""
    live, total, peak = {}, 0, 0
    for event in events:
        if event[0] == "alloc":
            live[event[1]] = event[2]
            total += event[2]
            peak = max(peak, total)
        elif event[0] == "free":
            total -= live.pop(event[1])
    return total, peak


def test_the_recorded_allocation_stream_adds_up_to_the_trackers_books():
    """What plan/allocator.py replays is the tracker's own bookkeeping, in order: every storage the
    tracker counts, the step's frees and a resize (a new block, then the old one freed)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = P.StorageTracker()
    tracker.events = []
    tracker.track(model, optimizer, [])
    with tracker:
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        resized = torch.empty(256)
        resized.untyped_storage().resize_(4096)
        assert _live_bytes(tracker.events) == (tracker.total, tracker.peak_total)
        del resized
    assert _live_bytes(tracker.events)[0] == tracker.total
    assert sum(e[0] == "alloc" for e in tracker.events) > 20  # the step's tensors, not only the model


def test_tracker_sees_inside_composite_ops_under_inference_mode():
    logits, target = torch.randn(64, 1000), torch.randint(0, 1000, (64,))
    tracker = P.StorageTracker()
    with torch.inference_mode(), tracker:
        torch.nn.functional.cross_entropy(logits, target)
    assert tracker.peak_total >= 64 * 1000 * 4  # log_softmax's output, inside cross_entropy


def test_patches_are_undone():
    import torch.nn.functional as F
    import transformers.masking_utils as masking

    dropout, sdpa, packed = F.dropout, F.scaled_dot_product_attention, masking.find_packed_sequence_indices
    with P.cuda_kernels(), P.unpacked_sequences():
        assert F.dropout is not dropout and masking.find_packed_sequence_indices is not packed
    assert (F.dropout, F.scaled_dot_product_attention, masking.find_packed_sequence_indices) == (dropout, sdpa, packed)


def test_cuda_dropout_saves_a_bool_mask():
    x = torch.randn(8, 8, requires_grad=True)
    saved = []
    with P.cuda_kernels(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.dropout(x, 0.1, True)
    assert [t.dtype for t in saved] == [torch.bool]
