"""Config fields that name a registry entry, checked against the registry itself when a config loads.

A field says which registry it names (`json_schema_extra=registry("policy loss")`, section.py); its values are
looked up in that Registry (stages/core/registry.py), found by its kind, so a new loss, tool or benchmark is a
valid config value as soon as it is registered, and a typo fails naming the key, the nearest name and the known
ones. A value equal to the field's default is not looked up (tests/unit/test_config.py checks every default is
registered): a config that keeps the defaults imports no stage code (no torch) to load.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from stages.core.registry import UnknownNameError, find_registry


def registry_fields(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """{dotted key: registry kind} of every field under `model` that names a registry entry."""
    found = {}
    for name, field in model.model_fields.items():
        nested = _section(field.annotation)
        if nested is not None:
            found.update(registry_fields(nested, f"{prefix}{name}."))
        elif isinstance(field.json_schema_extra, dict) and "registry" in field.json_schema_extra:
            found[f"{prefix}{name}"] = field.json_schema_extra["registry"]
    return found


def unknown_names(data: dict[str, Any], model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per value in the raw config `data` that its registry does not hold: `<key>: unknown <kind> ...`.
    Values of the wrong type are left to the model's validation."""
    problems = []
    for name, value in data.items():
        field = model.model_fields.get(name)
        if field is None:
            continue  # an unknown key: the model's validation names it
        nested = _section(field.annotation)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if nested is not None and isinstance(value, dict):
            problems += unknown_names(value, nested, f"{prefix}{name}.")
        elif "registry" in extra:
            default = field.get_default(call_default_factory=True)
            defaults = default if isinstance(default, (list, tuple)) else [default]
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, str) and item not in defaults:
                    problems += _lookup(f"{prefix}{name}", extra["registry"], item)
    return problems


def _lookup(key: str, kind: str, name: str) -> list[str]:
    try:
        find_registry(kind).get(name)
    except UnknownNameError as err:
        return [f"{key}: {err}"]
    return []


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
