"""What each stage's key covers, read off the code (never typed): the table in docs/caching.md.

For every line of the stage table (stages.core.stage_spec) the key module's code version (stages.core.codeversion)
covers a closure of `stages.*` modules. This module groups that closure into the packages of code it covers and the
config models it covers, and checks the rule the keys keep: a stage's key covers its own package, the shared runtime
(stages.core, stages.agent, stages.generation), the config models of the sections it reads and of the runtime it
drives (the agent's); never another stage's package (so editing an evaluation benchmark or `arpo plan` leaves RL
and SFT cached), never a command's (stages.cost, stages.rehearse), never another section's model.

Rewritten and checked with every other generated block: `python -m flows.cli docs --write` (flows/generated_docs.py),
which also prints what a key covers against the rule (`all_problems`).
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from stages.core.codeversion import STAGES as CODE
from stages.core.doc_block import read_block, replace_block
from stages.core.env import PROJECT_ROOT
from stages.core.stage_spec import STAGE_SPECS, StageSpec

# the runtime every stage may drive (names built, not written: a bare module-name string counts as an import here)
SHARED = tuple(f"stages.{name}" for name in ("core", "agent", "generation"))
# the config a runtime package reads (its key covers it when it covers the runtime): the agent's section, and the
# settings value stages.generation takes from whichever section samples (no YAML section of its own)
RUNTIME_CONFIG = {SHARED[1]: ("agent",), SHARED[2]: ()}
RUNTIME_MODULES = {SHARED[2]: {f"{SHARED[0]}.config.generation"}}
CONFIG = f"{SHARED[0]}.config"
CONFIG_BASE = {CONFIG, f"{CONFIG}.section", f"{CONFIG}.names"}  # what every section model is built on
DOC = PROJECT_ROOT / "docs" / "caching.md"
START, END = "<!-- key-coverage:start -->", "<!-- key-coverage:end -->"


def key_module(spec: StageSpec) -> str:
    return spec.module


def package(module: str) -> str:
    """stages.rl.verl.plugin -> stages.rl."""
    return ".".join(module.split(".")[:2])


def section_modules(section: str) -> set[str]:
    """The modules defining the config model of `section` and every model nested in it."""
    from stages.core.config.root import RunConfig

    seen: set[type] = set()
    todo: list[Any] = [RunConfig.model_fields[section].annotation]
    while todo:
        kind = todo.pop()
        for arg in typing.get_args(kind) or (kind,):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in seen:
                seen.add(arg)
                todo += [f.annotation for f in arg.model_fields.values()]
            elif typing.get_args(arg):
                todo.append(arg)
    return {kind.__module__ for kind in seen}


def coverage(spec: StageSpec) -> dict[str, list[str]]:
    """The packages of code and the config modules the stage's key covers."""
    closure = CODE.closure(key_module(spec))
    configs = sorted(m for m in closure if m.startswith(f"{CONFIG}.") and m not in CONFIG_BASE)
    code = sorted({package(m) for m in closure if not m.startswith(CONFIG) and m != "stages"})
    return {"code": code, "config": configs}


def problems(spec: StageSpec) -> list[str]:
    """What the stage's key covers that the rule says it must not."""
    cover = coverage(spec)
    own = package(key_module(spec))
    allowed_code = {own, *SHARED}
    sections = set(spec.sections).union(*(RUNTIME_CONFIG.get(p, ()) for p in cover["code"]))
    allowed_config = set().union(*(section_modules(s) for s in sections),
                                 *(RUNTIME_MODULES.get(p, set()) for p in cover["code"]))
    bad = [f"{spec.name}: covers {p} (another stage's package or a command's; move what it uses to stages.core)"
           for p in cover["code"] if p not in allowed_code]
    bad += [f"{spec.name}: covers the config model {m}, which is no section it reads ({', '.join(spec.sections)})"
            for m in cover["config"] if m not in allowed_config]
    return bad


def table() -> str:
    rows = ["| stage | key function | config sections read | code it covers | config models it covers |",
            "|---|---|---|---|---|"]
    for spec in STAGE_SPECS:
        cover = coverage(spec)
        models = ", ".join(m.removeprefix(f"{CONFIG}.") for m in cover["config"]) or "-"
        rows.append(f"| {spec.name} | `{spec.key_target}` | {', '.join(spec.sections)} | "
                    f"{', '.join(p.removeprefix('stages.') for p in cover['code'])} | {models} |")
    return "\n".join(rows)


def documented() -> str:
    return read_block(DOC, START, END)


def render(text: str) -> str:
    """docs/caching.md's `text` with the table rewritten."""
    return replace_block(text, START, END, table(), str(DOC))


def all_problems() -> list[str]:
    """Every stage key's problems (`problems`)."""
    return [problem for spec in STAGE_SPECS for problem in problems(spec)]
