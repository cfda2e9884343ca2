"""PhaseBill: one moment's device bytes per component, typed and immutable. A moment is built from
another as a delta (`start.with_(gradients=..., activations=...)`), and a component's name is
checked against the ledger's (plan/ledger.py COMPONENTS): a misspelt override fails at once instead
of adding a row nobody sums. It reads as the mapping the ledger stores, in the order it was built.
StepBill: one rank's step, every phase and backward's candidate moments, as the features adjust it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from trainplan.plan.ledger import COMPONENTS
from trainplan.plan.parts import Bytes, Part

_BILLED = frozenset(COMPONENTS) - {"runtime", "allocator_reserve"}  # those two the ledger adds itself


class PhaseBill(Mapping[str, int]):
    """Bytes per component at one moment of a phase; only the components the moment lists."""

    __slots__ = ("_bytes",)

    def __init__(self, components: Mapping[str, int] | None = None, /, **more: int) -> None:
        values = {**(components or {}), **more}
        if not _BILLED.issuperset(values):
            raise AssertionError(f"not a bill component: {sorted(set(values) - _BILLED)}")
        self._bytes = values

    def __getitem__(self, component: str) -> int:
        return self._bytes[component]

    def __iter__(self) -> Iterator[str]:
        return iter(self._bytes)

    def __len__(self) -> int:
        return len(self._bytes)

    def __repr__(self) -> str:
        return f"PhaseBill({self._bytes})"

    def with_(self, **changes: int) -> PhaseBill:
        """This moment with the named components at new values (added where the moment lacked them)."""
        return PhaseBill(self._bytes, **changes)

    def plus(self, **more: Part) -> PhaseBill:
        """This moment with the named components grown by a named term each: plus(gradients=("why", n))."""
        return PhaseBill(self._bytes, **{c: Bytes(self._bytes.get(c, 0), part) for c, part in more.items()})

    def without(self, *components: str) -> PhaseBill:
        """The moment with the named components at zero where it lists them (what moved elsewhere)."""
        return PhaseBill(self._bytes, **{c: 0 for c in components if c in self._bytes})

    @property
    def total(self) -> int:
        return sum(map(int, self._bytes.values()))  # compared, not explained: no terms to keep


@dataclass(frozen=True)
class StepBill:
    """One rank's training step as the features adjust it (features/<name>/plan.py `adjust`): each
    phase's bill but backward's, and the moments of backward that can be its peak, its start first (the
    plan takes whichever holds the most)."""

    phases: Mapping[str, Mapping[str, int]]
    moments: tuple[PhaseBill, ...]

    def with_phase(self, name: str, bill: Mapping[str, int]) -> StepBill:
        return StepBill(phases={**self.phases, name: bill}, moments=self.moments)

    def without_phase(self, name: str) -> StepBill:
        return StepBill(phases={k: v for k, v in self.phases.items() if k != name}, moments=self.moments)
