"""Name -> function registries. One registry per kind of thing, one call signature per registry.

A miss names every registered choice, so a typo in a config fails with the fix in the message.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from stages.core.errors import InputError

F = TypeVar("F", bound=Callable)


class UnknownNameError(InputError, KeyError):
    """Raised when a registry lookup misses; the message lists the known names (a config error: not retried)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain sentence
        return str(self.args[0])


class Registry(Generic[F]):
    """A typed name -> callable map filled by a decorator.

    >>> ADVANTAGES = Registry("advantage estimator")
    >>> @ADVANTAGES.register("grpo")
    ... def grpo(x): return x
    >>> ADVANTAGES.get("grpo") is grpo
    True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            if existing is not None and existing is not fn and existing.__qualname__ != fn.__qualname__:
                owner = f"{existing.__module__}.{existing.__qualname__}"
                raise ValueError(f"{self.kind} {name!r} is already registered to {owner}")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}.{hint} Known: {sorted(self._entries)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def ordered(self) -> list[str]:
        """Names in registration order (for registries whose order means something, e.g. the tools' tags)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
