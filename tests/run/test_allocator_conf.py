"""The engine runs the caching allocator's mode the plan assumed (memory.expandable_segments), unless the
user set PYTORCH_CUDA_ALLOC_CONF, which wins; the plan and the record say which."""

from __future__ import annotations

import pytest

from trainplan import config as C
from trainplan.plan.analytic import plan
from trainplan.run import dist


@pytest.mark.parametrize(("given", "expandable", "in_force"), [
    (None, True, "expandable_segments:True"),
    (None, False, None),
    ("max_split_size_mb:128", True, "max_split_size_mb:128"),  # the user's own setting wins
])  # fmt: skip
def test_train_sets_the_allocator_mode_unless_the_user_did(monkeypatch, given, expandable, in_force):
    monkeypatch.delenv(dist.ALLOC_CONF, raising=False)
    if given is not None:
        monkeypatch.setenv(dist.ALLOC_CONF, given)
    assert dist.configure_cuda_allocator(expandable) == in_force
    import os

    assert os.environ.get(dist.ALLOC_CONF) == in_force


def test_the_plan_bills_the_reserve_of_the_mode_it_runs():
    sets = {"model.source": "Llama-3.2-1B", "mode": "full", "hardware.gpus": "H100-80GB"}
    on = plan(C.load(None, [], sets)).devices[0]
    off = plan(C.load(None, [], {**sets, "memory.expandable_segments": False})).devices[0]
    assert (on.allocator_mode, off.allocator_mode) == ("expandable_segments", "default")
    assert on.peak_allocated == off.peak_allocated and on.reserve_bytes < off.reserve_bytes
    assert "expandable" in on.reserve_source and "not yet measured on a GPU" in on.reserve_source
    assert "measured" in off.reserve_source and "expandable_segments off" in off.reserve_source
    cpu = plan(C.load(None, [], {**sets, "hardware.gpus": "cpu"})).devices[0]
    assert cpu.to_json()["allocator_mode"] is None and cpu.reserve_bytes == 0
