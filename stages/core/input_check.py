"""Before any work: every input file the selected stages' config sections name, and every interpreter they run
under, checked (stages.core.input_files checks one field; stages.core.stage_spec says which sections a stage reads and
how to build a stage's interpreter). Part of the one pre-flight, stages.core.preflight.

Kept apart from stages.core.input_files, which the config models import: the stage table it reads is then part of no
stage's code version, and adding a stage recomputes none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import BaseModel

from stages.core.errors import MissingInputError
from stages.core.input_files import check_input, resolve
from stages.core.stage_spec import table


def check_inputs(cfg: BaseModel, stages: Iterable[str]) -> None:
    """Every set input field of the sections `stages` read: exists, readable, the right format. Raises the
    first problem as an InputError (MissingInputError for a missing file)."""
    wanted = set(stages)
    # in the table's order, so the same config fails on the same problem every time (a set's order varies by run)
    for name in dict.fromkeys(section for s in table().specs if s.selected_as in wanted for section in s.sections):
        if hasattr(cfg, name):
            for key, value, spec in _inputs(getattr(cfg, name), name):
                check_input(key, value, spec)
    check_interpreters(cfg, wanted)


def check_interpreters(cfg: BaseModel, stages: set[str]) -> None:
    """A stage set to run under another interpreter (run.interpreters) needs it here, before any work: else the
    stage's task fails with FileNotFoundError after the run has started (and is retried)."""
    run = getattr(cfg, "run", None)
    for stage, python in (getattr(run, "interpreters", None) or {}).items():
        path = resolve(python, project_relative=True)
        line = table().spec(stage)
        if line.selected_as in stages and not path.is_file():
            hint = f" ({line.interpreter_hint})" if line.interpreter_hint else ""
            raise MissingInputError(f"run.interpreters.{stage}={python}: {path} does not exist; build that "
                                    f"environment{hint}, or remove run.interpreters.{stage} to run the stage in "
                                    "this process")


def _inputs(section: BaseModel, prefix: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(dotted key, value, spec) of each set input field, skipping sections switched off (`enabled: false`)."""
    if getattr(section, "enabled", True) is False:
        return
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from _inputs(value, f"{prefix}.{name}")
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        spec = extra.get("input")
        if spec and value not in (None, "") and all(getattr(section, k) == v for k, v in spec["when"].items()):
            yield f"{prefix}.{name}", value, spec
