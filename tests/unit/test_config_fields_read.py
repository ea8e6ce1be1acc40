"""A config key that no code reads is a defect (a user sets it and nothing happens): every field of the run config
must be read somewhere in stages/, flows/ or tasks/.

"Read" is static and deliberately simple: the field's name appears as an attribute access (`cfg.rollback`) or as a
string constant (`"max_python"` in a key list, a `model_dump(include=...)`, a getattr) in those packages. Inside
stages/core/config only methods count, not validators (a validator checking a key is not a use of it). A name
that another attribute shares can hide an unread field; the check catches keys whose names nothing mentions,
which is how agent.inference.rollback / refiner went unnoticed.

A field that is intentionally read by nothing here (e.g. one only a subprocess or an external tool consumes by
name) is allowed by saying so on the field: `Field(..., json_schema_extra={"unread": "<who reads it and why>"})`
(CONTRIBUTING.md).
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from pydantic import BaseModel

from stages.core.config.root import RunConfig
from stages.core.env import PROJECT_ROOT

PACKAGES = ("stages", "flows", "tasks")
CONFIG_PACKAGE = Path("stages") / "core" / "config"


def config_models(cls: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[type[BaseModel]]:
    """The run config and every model nested in it (through lists, dicts, optionals)."""
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for info in cls.model_fields.values():
        stack = [info.annotation]
        while stack:
            kind = stack.pop()
            stack.extend(typing.get_args(kind))
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                config_models(kind, seen)
    return seen


def _is_validator(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        "validator" in ast.unparse(d) for d in node.decorator_list)


def names_read(root: Path = PROJECT_ROOT) -> set[str]:
    names: set[str] = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            skip: set[int] = set()
            if path.parent.relative_to(root) == CONFIG_PACKAGE:
                skip = {id(n) for v in ast.walk(tree) if _is_validator(v) for n in ast.walk(v)}
            for node in ast.walk(tree):
                if id(node) in skip:
                    continue
                if isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    return names


def unread_fields(read: set[str]) -> list[str]:
    out = []
    for model in sorted(config_models(RunConfig), key=lambda m: m.__name__):
        for name, info in model.model_fields.items():
            allowed = isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("unread")
            if name not in read and not allowed:
                out.append(f"{model.__name__}.{name}")
    return out


def test_every_config_field_is_read_somewhere() -> None:
    missing = unread_fields(names_read())
    assert not missing, (f"config fields that no code in {PACKAGES} reads: {missing}. Use them, remove them, or "
                         "mark an intentional one with json_schema_extra={'unread': '<why>'}")


def test_the_check_sees_an_unread_field() -> None:
    # the inference section's keys were configuration nobody read before they were wired into the text loop
    read = names_read() - {"rollback", "max_rollback"}
    assert {"InferenceToolsSection.rollback", "InferenceToolsSection.max_rollback"} <= set(unread_fields(read))
    models = {m.__name__ for m in config_models(RunConfig)}
    assert {"RolloutSection", "InferenceToolsSection", "WebSearchSection", "VerlSection"} <= models
