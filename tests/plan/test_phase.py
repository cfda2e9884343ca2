"""PhaseBill: a moment of a phase as a typed delta of another, its component names checked."""

import pytest

from trainplan.plan.phase import PhaseBill


def test_a_moment_is_a_delta_and_leaves_its_origin_alone():
    start = PhaseBill(weights=10, gradients=4, activations=7)
    end = start.with_(gradients=9).plus(activations=-2)
    assert dict(start) == {"weights": 10, "gradients": 4, "activations": 7}  # unchanged
    assert list(end.items()) == [("weights", 10), ("gradients", 9), ("activations", 5)]  # the order it was built
    assert end.total == 24 and end.without("weights", "kv_cache") == {"weights": 0, "gradients": 9, "activations": 5}
    assert list(start.with_(optimizer_temp=3)) == ["weights", "gradients", "activations", "optimizer_temp"]


@pytest.mark.parametrize("build", [lambda: PhaseBill(gradient=1), lambda: PhaseBill(weights=1).with_(activation=2)])
def test_a_misspelt_component_fails_at_once(build):
    with pytest.raises(AssertionError, match="not a bill component"):
        build()
