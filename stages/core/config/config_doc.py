"""The config page, docs/config.md, made from the config models (never typed): every section's fields with
their type, default, bounds, description and when they are used.

The models are the one place a default and its description live (CONTRIBUTING.md, Conventions); this page is
how a reader sees them all. Per section (a model nested in `RunConfig`) one table: the dotted key, its type, its
default, its bounds (`ge`/`gt`/`le`/`lt`, the choices of a `Literal`, the names a registry holds now), its
description, and when it is used (`used_when`: refused when set under another mode; `input_file`: checked before
any work; `unread`: read by a tool outside). A section whose model and default another section already showed
links there instead of repeating the table (`eval.judge.serve` is a `serve`).

Rewritten and checked with every other generated block: `python -m flows.cli docs --write` (flows/generated_docs.py),
which also fails on a field without a description (`undocumented`); so does tests/unit/test_config_doc.py.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from stages.core.config.root import RunConfig
from stages.core.doc_block import DOCS_COMMAND
from stages.core.env import PROJECT_ROOT
from stages.core.registry import find_registry
from stages.core.stage_spec import TABLE

TAG = re.compile(r"<(?=[A-Za-z/!?])")  # what Markdown would read as the start of an HTML tag
TOP = "Top level"  # the heading of RunConfig's own settings
DOC = PROJECT_ROOT / "docs" / "config.md"
BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"),
          (at.MinLen, "min_length", "length >="), (at.MaxLen, "max_length", "length <="))


@dataclass(frozen=True)
class Table:
    key: str                     # dotted path of the section ("" = the top level)
    model: type[BaseModel]
    rows: list[list[str]]        # key, type, default, bounds, description, when used
    same_as: str | None = None   # an earlier section with the same model and default: linked, not repeated


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _nested(field: FieldInfo) -> BaseModel | None:
    default = field.get_default(call_default_factory=True)
    return default if isinstance(default, BaseModel) else None


def leaf_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, FieldInfo]:
    """{dotted key: field} of every setting under `model` (a nested section is walked, not listed)."""
    found: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        nested = _nested(field)
        if nested is not None:
            found.update(leaf_fields(type(nested), f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = field
    return found


def undocumented(model: type[BaseModel] = RunConfig) -> list[str]:
    """The keys whose field has no description."""
    return [key for key, field in leaf_fields(model).items() if not (field.description or "").strip()]


def type_name(annotation: Any) -> str:
    """`int | None`, `list[str]`, `str` for a Literal of strings (its choices go under bounds)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(dict.fromkeys(type(a).__name__ for a in args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def choices(annotation: Any) -> list[Any]:
    """The values of every Literal inside the annotation, in order."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [c for arg in typing.get_args(annotation) for c in choices(arg)]


def value_text(value: Any) -> str:
    """A default as a profile writes it: null, true, 0.2, [0.9, 0.999], a plain string."""
    if isinstance(value, str):
        return value if value.strip() and value == value.strip() else json.dumps(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, ensure_ascii=False, default=str)


def bounds(field: FieldInfo) -> str:
    parts = [f"{sign} {getattr(item, attr)}" for item in field.metadata for kind, attr, sign in BOUNDS
             if isinstance(item, kind)]
    found = choices(field.annotation)
    if found:
        parts.append("one of " + ", ".join(value_text(c) for c in found))
    kind = _extra(field).get("registry")
    if kind:
        parts.append(f"{kind} registry: " + ", ".join(find_registry(kind).ordered()))
    return "; ".join(parts)


def when_used(field: FieldInfo, siblings: dict[str, FieldInfo]) -> str:
    extra, parts = _extra(field), []
    for mode, values in (extra.get("used_when") or {}).items():
        if mode in siblings:  # a mode named by a base class the section does not have (DPO's LoRA) applies never
            parts.append(f"when {mode} = {' or '.join(value_text(v) for v in values)}")
    spec = extra.get("input")
    if spec:
        what = f"input file: {spec['kind']}"
        what += f" with columns {', '.join(spec['columns'])}" if spec.get("columns") else ""
        what += "".join(f", when {k} = {value_text(v)}" for k, v in spec.get("when", {}).items())
        what += ", relative to the project root" if spec.get("project_relative") else ""
        parts.append(what + " (checked before any work)")
    if extra.get("unread"):
        parts.append(f"read by {extra['unread']}")
    return "; ".join(parts)


def prose(text: str) -> str:
    """Whitespace squeezed, and outside code spans a `<name>` kept from reading as an HTML tag."""
    parts = " ".join(text.split()).split("`")
    return "`".join(TAG.sub("&lt;", part) if i % 2 == 0 else part for i, part in enumerate(parts))


def cell(text: str) -> str:
    """One table cell: prose with its pipes escaped."""
    return prose(text).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str) -> list[list[str]]:
    fields = model.model_fields
    return [[f"`{prefix}{name}`", cell(type_name(f.annotation)),
             f"`{cell(value_text(f.get_default(call_default_factory=True)))}`", cell(bounds(f)),
             cell(f.description or ""), cell(when_used(f, fields))]
            for name, f in fields.items() if _nested(f) is None]


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, BaseModel]]:
    """(dotted key, default) of every section nested under `model`, depth first in field order."""
    out = []
    for name, field in model.model_fields.items():
        nested = _nested(field)
        if nested is not None:
            out += [(f"{prefix}{name}", nested), *_sections(type(nested), f"{prefix}{name}.")]
    return out


def _identity(section: BaseModel) -> tuple[type, str]:
    return type(section), json.dumps(section.model_dump(mode="json"), sort_keys=True)


def tables(model: type[BaseModel] = RunConfig) -> list[Table]:
    """One table per section, depth first in field order. A section whose model and default another shows too is
    shown once, at its shallowest key (`serve` rather than `eval.judge.serve`); the others link there."""
    found = _sections(model)
    home: dict[tuple[type, str], str] = {}
    for key, section in sorted(found, key=lambda item: item[0].count(".")):  # stable: field order within a depth
        home.setdefault(_identity(section), key)
    linked = {key for key, section in found if home[_identity(section)] != key}
    out = [Table("", model, rows(model, ""))]
    for key, section in found:
        if any(key.startswith(f"{other}.") for other in linked):
            continue  # inside a section shown at another key: its subsections are shown there too
        shown = home[_identity(section)]
        out.append(Table(key, type(section), rows(type(section), f"{key}.") if shown == key else [],
                         same_as=None if shown == key else shown))
    return out


def heading(key: str) -> str:
    return key or TOP


def anchor(key: str) -> str:
    """GitHub's anchor of the section's heading (dots dropped, spaces to hyphens)."""
    return heading(key).replace(".", "").replace(" ", "-").lower()


def _intro(table: Table) -> list[str]:
    doc = inspect.cleandoc(table.model.__doc__ or "")
    lines = [prose(part) for part in doc.split("\n\n") if part.strip()]
    top = table.key.split(".")[0]
    readers = TABLE.reading(top) if table.key == top else ()
    if readers:
        lines.append("Stages that take this section: " + ", ".join(f"`{r}`" for r in readers) + ".")
    return lines


def render() -> str:
    out = ["# Config keys", "",
           f"Generated from the config models (`stages/core/config/`) by `{DOCS_COMMAND}`: do not edit it by hand "
           "(`tests/unit/test_config_doc.py` fails when it is stale or a field has no description). The "
           "models hold every default, once; a profile (`configs/profiles/`) states only what differs from them, "
           "and `arpo config show --diff -p NAME` lists what it changes.", "",
           "Columns: **bounds** are the checks a value must pass when the config loads (a registry's names are "
           "those registered now); **when used** says a setting belongs to one mode of its section (set under "
           "another mode, it is refused), names an input file (checked before any work) or a tool outside that "
           "reads it. `None` in a type is `null` in YAML.", ""]
    found = tables()
    out += [", ".join(f"[{heading(t.key)}](#{anchor(t.key)})" for t in found), ""]
    for table in found:
        out += [f"{'###' if '.' in table.key else '##'} {heading(table.key)}", ""]
        if table.same_as:
            out += [f"The same fields and defaults as [{table.same_as}](#{anchor(table.same_as)}).", ""]
            continue
        out += [line for text in _intro(table) for line in (text, "")]
        out += ["| key | type | default | bounds | description | when used |", "|---|---|---|---|---|---|"]
        out += ["| " + " | ".join(row) + " |" for row in table.rows] + [""]
    return "\n".join(out)
