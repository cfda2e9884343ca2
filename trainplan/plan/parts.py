"""Bytes: a component's bytes with the named terms they sum to, so that the ledger's why line names every
one (a plain int is one term: the one the component's note explains, `DeviceLedger.noted`). Imports nothing.
"""

from __future__ import annotations

Part = tuple[str | None, int]  # (what it is, bytes); None: the term the component's note explains


_add, _new = int.__add__, int.__new__  # int's own: Bytes' reflected add would build a Bytes


class Bytes(int):
    """An int that remembers its terms: `Bytes(("the head's gradient", n), (None, m))` is n + m. Adding
    keeps the terms (a plain int added is an unnamed one); any other arithmetic gives a plain int, whose
    terms the why line cannot name (tests/plan/test_why_sums.py finds it)."""

    parts: tuple[Part, ...]

    def __new__(cls, *parts: Part | int) -> Bytes:
        # the planner's hot path (an advise search builds some 300,000): one pass, int's own addition
        flat: list[Part] = []
        total = 0
        for p in parts:
            label, n = (None, p) if isinstance(p, int) else p
            if label is None and isinstance(n, Bytes):
                flat += n.parts
                total = _add(total, int(n))
            else:
                n = n if type(n) is int else int(n)
                if n:
                    flat.append((label, n))
                    total = _add(total, n)
        self = _new(cls, total)
        self.parts = tuple(flat)
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
        # the hot path (sums of terms): both flat already, so the terms are the two tuples joined
        kind = type(other)
        if kind is Bytes:
            return _joined(_add(self, other), self.parts + other.parts)
        if kind is int:  # a plain int is one unnamed term (the note's, or the test finds it)
            return _joined(_add(self, other), self.parts + ((None, other),)) if other else self
        if isinstance(other, int):
            return Bytes(self, other)
        return int(self) + other

    def __radd__(self, other):  # before int's own __add__, a subclass's reflected method: sum() keeps the terms
        if type(other) is int:
            return _joined(_add(other, self), ((None, other), *self.parts)) if other else self
        if isinstance(other, int):
            return Bytes(other, self)
        return other + int(self)


def _joined(total: int, parts: tuple[Part, ...]) -> Bytes:
    """A Bytes of terms already flat and non-zero, and their total."""
    out = _new(Bytes, total)
    out.parts = parts
    return out


def parts_of(nbytes: int) -> tuple[Part, ...]:
    """The terms of a component's bytes: a Bytes' own, or one unnamed term."""
    if isinstance(nbytes, Bytes):
        return nbytes.parts
    return ((None, nbytes),) if nbytes else ()
