"""A trainplan process starts without the cyclic garbage collector.

Start-up imports torch and transformers: about 370,000 objects the collector tracks, which live as long
as the process. It walks them again and again while they are created (about 0.6 s of a 3.6 s start-up,
docs/benchmarks.md) and once more at interpreter exit (about 1 s). So the process's entry holds
collection until its start-up is done (the model built), then moves what start-up made out of the
collector's sight (gc.freeze) and collects as usual; at exit it freezes again, so finalization does
not walk the heap it is about to drop. Only the process's own entry does this: `cli.main`, called in
a test's process, leaves the collector alone.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_held = False


def hold() -> None:
    """The process's entry: no collections until release()."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """Start-up is done: its objects are frozen (kept, never walked again) and collection resumes."""
    global _held
    if _held:
        gc.freeze()
        gc.enable()
        _held = False


def leave() -> None:
    """The process is about to exit: finalization need not walk what it drops."""
    gc.freeze()


@contextmanager
def paused() -> Iterator[None]:
    """Planning many candidates (an advise search): collection waits until the search is done. The
    search makes a few hundred thousand short-lived containers, which refcounting frees, and few cycles
    (about 20,000 objects, 3 MB, for the 70B search); the collector's walks over the young ones took a
    quarter of its time. Where collection was already off (held), it stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
