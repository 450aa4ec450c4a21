"""One registry idiom for every rule table in memtrim (roles, categories, diagnoses, allocator charges,
magnitude and rounding rules), after ``torch/utils/flop_counter.py``'s ``register_flop_formula``.

A registry maps keys to small functions. Registering a key twice is refused (a second rule would
silently replace the first); looking up a missing key raises :class:`UnknownKey`, which lists the valid
keys. Iteration follows registration order, so registries whose rules are tried in turn ("first match
wins") are ordered by where their rules are defined.

This module is a leaf: it imports nothing of memtrim, and every stage may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
F = TypeVar("F")

_MISSING = object()


class UnknownKey(KeyError):
    """A key that no rule is registered for; the message lists the keys that are."""

    def __str__(self) -> str:  # KeyError's own __str__ shows the repr of the message
        return str(self.args[0])


class DuplicateRegistration(ValueError):
    """A key registered twice in one registry."""


def _key_text(key: object) -> str:
    return key if isinstance(key, str) else str(key)


class Registry(Generic[K, V]):
    """Keys -> registered values, duplicates refused.

    ``what`` names the kind of rule for messages (``"diagnosis rule"``); ``how`` says how to add one
    (``"memtrim.doctor.diagnosis.rule"``).
    """

    __slots__ = ("_items", "how", "what")

    def __init__(self, what: str, how: str) -> None:
        self.what = what
        self.how = how
        self._items: dict[K, V] = {}

    def add(self, key: K, value: V) -> V:
        if key in self._items:
            raise DuplicateRegistration(
                f"a {self.what} is already registered for {_key_text(key)!r} "
                f"({_describe(self._items[key])}); pick another key or remove the first registration"
            )
        self._items[key] = value
        return value

    def register(self, *keys: K) -> Callable[[F], F]:
        """Decorator: register the decorated function under every key in ``keys``."""
        if not keys:
            raise TypeError(f"register() needs at least one key for a {self.what}")

        def wrap(value: F) -> F:
            # refuse before adding any, so a half-registered rule is never left behind
            taken = [key for key in keys if key in self._items]
            if taken:
                self.add(taken[0], value)  # type: ignore[arg-type]  # raises DuplicateRegistration
            for key in keys:
                self.add(key, value)  # type: ignore[arg-type]
            return value

        return wrap

    def unregister(self, key: K) -> V:
        """Remove and return the rule for ``key`` (for tests that register a rule temporarily)."""
        return self._items.pop(key) if key in self._items else self[key]

    def __getitem__(self, key: K) -> V:
        try:
            return self._items[key]
        except KeyError:
            raise UnknownKey(self._miss(key)) from None

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: V) -> V: ...
    def get(self, key: K, default: object = None) -> object:
        return self._items.get(key, default)

    def require(self, key: K, hint: str = "") -> V:
        """Like ``registry[key]``, with ``hint`` appended to the error."""
        try:
            return self._items[key]
        except KeyError:
            raise UnknownKey(self._miss(key) + (f"; {hint}" if hint else "")) from None

    def _miss(self, key: object) -> str:
        valid = ", ".join(repr(_key_text(k)) for k in self._items) or "none"
        return (
            f"no {self.what} is registered for {_key_text(key)!r}; valid: {valid} (add one with {self.how})"
        )

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[K]:
        return list(self._items)

    def values(self) -> list[V]:
        return list(self._items.values())

    def items(self) -> list[tuple[K, V]]:
        return list(self._items.items())

    def __repr__(self) -> str:
        return f"<Registry of {len(self)} {self.what}(s)>"


def _describe(value: object) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__name__
    module = getattr(value, "__module__", None)
    return f"{module}.{name}" if module else str(name)
