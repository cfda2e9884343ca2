"""Checkpoints: `format` is the only writer and reader of the files; `manager` is one run's policy
(where, how often, resume and rollback), built once per run."""

from trainplan.run.checkpoint.format import (
    CheckpointError,
    latest_valid,
    load,
    optimizer_hash,
    save,
    tensor_hash,
    trainable_state,
    validate,
)

__all__ = [
    "CheckpointError",
    "latest_valid",
    "load",
    "optimizer_hash",
    "save",
    "tensor_hash",
    "trainable_state",
    "validate",
]
