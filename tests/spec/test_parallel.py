import pytest

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.spec.model import load_model_spec
from trainplan.spec.parallel import build_parallel_dims, resolve_batch

LLAMA8B = load_model_spec("Llama-3.1-8B")


def dims(world, **kw):
    return build_parallel_dims(C.ParallelConfig(**kw), world, LLAMA8B)


def test_degrees_multiply_to_world_size():
    d = dims(16, tp=2, pp=2)
    assert (d.dp, d.tp, d.pp) == (4, 2, 2)


def test_world_size_that_does_not_multiply_out():
    with pytest.raises(ConfigError, match=r"parallel\.tp: tp 4 x pp 2 = 8 does not divide the world size 12"):
        dims(12, tp=4, pp=2)


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match="tp 3 does not divide the 32 attention heads and 8 KV heads"):
        dims(3, tp=3)


def test_more_stages_than_layers():
    with pytest.raises(ConfigError, match=r"parallel\.pp: 64 pipeline stages exceed the 32 layers"):
        dims(64, pp=64)


def test_rank_coordinates_are_tp_innermost():
    d = dims(8, tp=2, pp=2)  # dp = 2
    assert [d.coords(r) for r in range(8)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


def test_stage_layers_cover_every_layer_once():
    d = build_parallel_dims(C.ParallelConfig(pp=3), 3, LLAMA8B)
    spans = [list(d.stage_layers(s, 32)) for s in range(3)]
    assert [len(s) for s in spans] == [11, 11, 10]
    assert sum(spans, []) == list(range(32))


@pytest.mark.parametrize(
    ("given", "dp", "expected"),
    [
        ({"global_batch_size": 64, "micro_batch_size": 2}, 4, (2, 8, 64)),
        ({"global_batch_size": 64, "grad_accum_steps": 4}, 4, (4, 4, 64)),
        ({"micro_batch_size": 4, "grad_accum_steps": 2}, 8, (4, 2, 64)),
        ({"global_batch_size": 8}, 8, (1, 1, 8)),
        ({}, 2, (1, 1, 2)),
    ],
)
def test_any_two_give_the_third(given, dp, expected):
    b = resolve_batch(C.BatchConfig(**given), dp)
    assert (b.micro_batch_size, b.grad_accum_steps, b.global_batch_size) == expected


def test_indivisible_global_batch_says_why():
    with pytest.raises(
        ConfigError,
        match=r"batch\.global_batch_size: 10 is not divisible by micro_batch_size 4 x "
        r"data-parallel degree 2 = 8",
    ):
        resolve_batch(C.BatchConfig(global_batch_size=10, micro_batch_size=4), 2)


def test_inconsistent_triple():
    with pytest.raises(ConfigError, match="give only two of the three"):
        resolve_batch(C.BatchConfig(global_batch_size=10, micro_batch_size=1, grad_accum_steps=1), 2)
