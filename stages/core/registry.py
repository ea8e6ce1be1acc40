"""Name -> function (or spec) registries. One registry per kind of thing, one call signature per registry.

A miss names every registered choice, so a typo in a config fails with the fix in the message. A config field
that names an entry says which registry (`json_schema_extra=registry("policy loss")`, stages/core/config/
section.py); `arpo run` checks it against the registry when the config loads (`find_registry`).
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable, ItemsView, Iterator, Mapping, ValuesView
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

from stages.core.errors import InputError

F = TypeVar("F")


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

    def __init__(self, kind: str, entries: Mapping[str, F] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, F] = dict(entries or {})

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            same = getattr(existing, "__qualname__", None) == getattr(fn, "__qualname__", ...)
            if existing is not None and existing is not fn and not same:
                owner = f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}"
                raise ValueError(f"{self.kind} {name!r} is already registered to {owner}")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            close = difflib.get_close_matches(name, self._entries, n=1) if isinstance(name, str) else []
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}.{hint} Known: {sorted(self._entries)}"
            ) from None

    __getitem__ = get

    def items(self) -> ItemsView[str, F]:
        """(name, entry) in registration order."""
        return self._entries.items()

    def values(self) -> ValuesView[F]:
        return self._entries.values()

    def names(self) -> list[str]:
        return sorted(self._entries)

    def ordered(self) -> list[str]:
        """Names in registration order (for registries whose order means something, e.g. the tools' tags)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))


_MADE_HERE = re.compile(r"""\bRegistry\(\s*["']([^"']+)["']""")


@cache
def _registry_modules() -> dict[str, list[str]]:
    """kind -> the stages modules whose text makes a `Registry("<kind>"...)` (read, not imported)."""
    root = Path(__file__).resolve().parents[1]
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue  # this module's examples make none
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for kind in _MADE_HERE.findall(path.read_text(encoding="utf-8")):
            found.setdefault(kind, []).append(module)
    return found


def registry_kinds() -> list[str]:
    """Every kind of registry the stages modules make."""
    return sorted(_registry_modules())


@cache
def find_registry(kind: str) -> Registry[Any]:
    """The registry of one kind ("policy loss"): its module is found by its text and imported (the registrations
    in it run), then the module-level Registry of that kind is returned. A config field names registries this
    way, so the config models import no stage code."""
    for module_name in _registry_modules().get(kind, []):
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, Registry) and value.kind == kind:
                return value
    raise LookupError(f"no stages module defines Registry({kind!r}); known kinds: {registry_kinds()}")
