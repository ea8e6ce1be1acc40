"""Base class of every config section: frozen, unknown keys rejected, settings the chosen mode ignores refused.

One rule for every section: a field that only matters in some modes of its section says so with
`Field(..., json_schema_extra=used_when(source="parquet"))` (the mode is a sibling field). Given any value but
its default while the section is in another mode, the field is refused, naming the mode and the fix
(`data.train_path` under `data.source=synthetic`). Mark optional settings a user gives to ask for that mode (a
path, a URL); leave unmarked the tuned defaults a profile may carry for a mode it does not use now (e.g.
`data.synthetic.*` in a profile a user switches to parquet data).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

IGNORED_SETTING = "ignored_setting"  # the pydantic error type of the rule (explained by config.loader.explain)


def registry(kind: str) -> dict[str, Any]:
    """`json_schema_extra` of a field that names an entry of a registry (stages.core.registry.Registry), e.g.
    `registry("policy loss")`: the loaded config is checked against the registry itself (stages/core/config/
    names.py), never against a copy of its names. A list field names one entry per element."""
    return {"registry": kind}


def used_when(**modes: Any) -> dict[str, Any]:
    """`json_schema_extra` of a field used only when each named sibling has one of the given values."""
    return {"used_when": {name: tuple(v) if isinstance(v, (tuple, list)) else (v,) for name, v in modes.items()}}


def ignored_settings(section: BaseModel) -> list[tuple[str, Any, str, Any, tuple[Any, ...]]]:
    """(field, value, mode field, its value, the values that use the field) for each set field the mode ignores."""
    fields = type(section).model_fields
    found = []
    for name, field in fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        modes = extra.get("used_when") or {}
        value, default = getattr(section, name), field.get_default(call_default_factory=True)
        if not modes or value == default:
            continue
        shown = name
        if isinstance(value, BaseModel) and isinstance(default, BaseModel):  # name the sub-key that was set
            changed = next(k for k in type(value).model_fields if getattr(value, k) != getattr(default, k))
            shown, value = f"{name}.{changed}", getattr(value, changed)
        found += [(shown, value, mode, getattr(section, mode), allowed) for mode, allowed in modes.items()
                  if mode in fields and getattr(section, mode) not in allowed]
    return found


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    @model_validator(mode="after")
    def _no_ignored_settings(self) -> Section:
        found = ignored_settings(self)
        if found:
            name, value, mode, chosen, allowed = found[0]
            raise PydanticCustomError(IGNORED_SETTING, "{field}={value} is ignored under {mode}={chosen}",
                                      {"field": name, "value": value, "mode": mode, "chosen": chosen,
                                       "allowed": list(allowed)})
        return self
