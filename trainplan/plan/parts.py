"""Bytes: a component's bytes with the named terms they sum to, so that the ledger's why line names every
one (a plain int is one term: the one the component's note explains, `DeviceLedger.noted`). Imports nothing.
"""

from __future__ import annotations

Part = tuple[str | None, int]  # (what it is, bytes); None: the term the component's note explains


class Bytes(int):
    """An int that remembers its terms: `Bytes(("the head's gradient", n), (None, m))` is n + m. Adding
    keeps the terms (a plain int added is an unnamed one); any other arithmetic gives a plain int, whose
    terms the why line cannot name (tests/plan/test_why_sums.py finds it)."""

    parts: tuple[Part, ...]

    def __new__(cls, *parts: Part | int) -> Bytes:
        terms = tuple((None, p) if isinstance(p, int) else p for p in parts)
        flat: list[Part] = []
        for label, n in terms:
            flat += n.parts if isinstance(n, Bytes) and label is None else [(label, int(n))]
        self = super().__new__(cls, sum(n for _, n in flat))
        self.parts = tuple((label, n) for label, n in flat if n)
        return self

    def merged(self) -> Bytes:
        """The same sum with the terms of one name added into one (every rank's "optimizer states")."""
        out: dict[str | None, int] = {}
        for label, n in self.parts:
            out[label] = out.get(label, 0) + n
        return Bytes(*out.items())

    def __getnewargs__(self) -> tuple[Part, ...]:
        return self.parts

    def __add__(self, other):
        if isinstance(other, int):  # a plain int is one unnamed term (the note's, or the test finds it)
            return Bytes(self, other)
        return int(self) + other

    def __radd__(self, other):  # before int's own __add__, a subclass's reflected method: sum() keeps the terms
        if isinstance(other, int):
            return Bytes(other, self)
        return other + int(self)


def parts_of(nbytes: int) -> tuple[Part, ...]:
    """The terms of a component's bytes: a Bytes' own, or one unnamed term."""
    if isinstance(nbytes, Bytes):
        return nbytes.parts
    return ((None, nbytes),) if nbytes else ()
