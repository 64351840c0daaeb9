"""Name -> function registries whose entries carry their traits, and which list the valid
names when a lookup fails.

A config key selects an entry by name (`algorithm.advantage: gae`); what the rest of the
system needs to know about that entry ("needs a critic", "keeps the loss mask") is a trait
given where it is registered, never a string comparison with its name elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)
T = TypeVar("T")


@dataclass(frozen=True)
class NoTraits:
    """The traits of a registry whose entries differ only in what they compute."""


class Registry(Generic[F, T]):
    def __init__(self, kind: str, traits: type[T] = NoTraits) -> None:
        self.kind = kind
        self._traits_type = traits
        self._entries: dict[str, tuple[F, T]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[F], F]:
        """Register the decorated function as `name`, with its traits (the registry's traits
        dataclass's fields; the ones not given take that dataclass's defaults)."""
        entry_traits = self._traits_type(**traits)

        def add(fn: F) -> F:
            assert name not in self._entries, f"{self.kind} {name!r} registered twice"
            self._entries[name] = (fn, entry_traits)
            return fn

        return add

    def get(self, name: str) -> F:
        return self._entry(name)[0]

    def traits(self, name: str) -> T:
        return self._entry(name)[1]

    def names(self, where: Callable[[T], bool] | None = None) -> list[str]:
        """The registered names, sorted; with `where`, those whose traits satisfy it."""
        return sorted(n for n, (_, t) in self._entries.items() if where is None or where(t))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> tuple[F, T]:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}")
        return self._entries[name]
