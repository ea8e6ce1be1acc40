"""The stages of the pipeline, one line each: every other fact about a stage is derived from this table.

Derived from it: the stage order and the names `--only/--until/--refresh` take (stages.core.selection), the
`StageName` type of the flow parameters, which config sections' input files are checked before a run and which other
pre-flight checks run (stages.core.preflight), which stages may run under another interpreter (run.interpreters),
each stage task (tasks.stage_tasks.entry_task: its entry point, key function, output folder and retries; the task's
name is the stage's, the folder under run.output_root too), and the `stage-<name>` deployments (the generated
section of prefect.yaml: `python -m flows.cli docs --write`, checked by tests/unit/test_stage_spec.py). What a
stage's task publishes is not a line's field: the task layer registers its hook, `@publishes("<stage>")` in
tasks/publish.py, and the hook's inputs are checked against this line's entry when tasks/publish.py loads.

Adding a stage: CONTRIBUTING.md, "Adding a stage" (the one statement of the recipe).

No stage module imports this table (a test holds that), so adding a stage leaves every other stage's key as it was.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from stages.core.errors import InputError

# the pre-flight checks a stage asks for ("module:function", called as fn(cfg, stages) before any work when the
# stage runs; each distinct check runs once per run, in the order the table first names it: stages.core.preflight)
SEAMS = "stages.sft.seam_preflight:preflight_seams"   # where SFT, RL and eval would tokenize differently
MEMORY = "stages.cost.memory:check_memory"            # a verl run whose memory estimate exceeds the GPU
BENCHMARKS = "stages.eval.preflight:preflight_benchmarks"     # every configured benchmark's files


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """name: the stage's name, its output folder under run.output_root and its Prefect task name.
    sections: the config sections it reads (their input files are checked before a run that includes it; its key
    may cover their models and no other section's). entry: "module:function" of its entry point; that module also
    holds `key`, the name of its key function (folder name and Prefect cache key). isolatable: may run under another
    interpreter (run.interpreters.<name>; `interpreter_hint` says how to build one). part_of: a stage selected,
    refreshed and deployed with another (DPO belongs to SFT). group: the selection group it belongs to (`eval` =
    infer + score + report), which is also its deployment. checks: the pre-flight checks it needs beyond its input
    files. retries: how often its task retries a transient failure (bootstrap downloads a model)."""

    name: str
    sections: tuple[str, ...]
    entry: str
    key: str
    isolatable: bool = False
    part_of: str | None = None
    group: str | None = None
    checks: tuple[str, ...] = ()
    interpreter_hint: str = ""
    retries: int = 1

    @property
    def module(self) -> str:
        """The stage's entry module: its key function lives there and hashes its code version."""
        return self.entry.partition(":")[0]

    @property
    def key_target(self) -> str:
        """"module:function" of the key function."""
        return f"{self.module}:{self.key}"

    @property
    def selectable(self) -> bool:
        return self.part_of is None

    @property
    def selected_as(self) -> str:
        """The name the stage selection knows it by (DPO runs and refreshes as part of SFT)."""
        return self.part_of or self.name

    @property
    def deployment(self) -> str:
        """The stage deployment that runs it alone (its upstream from cache)."""
        return f"stage-{self.group or self.selected_as}"


STAGE_SPECS: tuple[StageSpec, ...] = (
    # data first: a bad data file fails in seconds, before a model is downloaded or converted
    StageSpec(name="data", sections=("data",), entry="stages.data.prepare:prepare_data", key="data_key"),
    StageSpec(name="bootstrap", sections=("model",), entry="stages.bootstrap.model:bootstrap_model",
              key="bootstrap_key", retries=2),
    StageSpec(name="sft", sections=("sft", "agent"), entry="stages.sft.stage:run_sft", key="sft_key", isolatable=True,
              checks=(SEAMS,)),
    StageSpec(name="dpo", sections=("sft", "agent"), entry="stages.sft.dpo:run_dpo", key="dpo_key", isolatable=True,
              part_of="sft"),
    StageSpec(name="rl", sections=("rl", "agent"), entry="stages.rl.stage:run_rl", key="rl_key", isolatable=True,
              checks=(SEAMS, MEMORY),
              interpreter_hint="./scripts/setup-gpu.sh builds .venv-verl; ./scripts/setup-verl.sh --cpu builds "
                               ".venv-verl-cpu"),
    StageSpec(name="merge", sections=("merge",), entry="stages.rl.merge:merge_checkpoint", key="merge_key",
              isolatable=True),
    StageSpec(name="heldout", sections=("eval", "agent"), entry="stages.heldout.stage:evaluate_heldout",
              key="heldout_key", checks=(SEAMS,)),
    StageSpec(name="infer", sections=("eval", "agent", "serve"), entry="stages.eval.inference:run_inference",
              key="infer_key", group="eval", checks=(SEAMS, BENCHMARKS)),
    StageSpec(name="score", sections=("eval",), entry="stages.eval.scoring:score_predictions", key="scoring_key",
              group="eval"),
    StageSpec(name="report", sections=("eval",), entry="stages.eval.report:build_report", key="report_key",
              group="eval"),
)


def nearest(name: object, known: Iterable[str]) -> str:
    """' (did you mean 'a' or 'b'?)' for the names in `known` nearest to `name`; '' when none is near."""
    close = difflib.get_close_matches(name, list(known), n=3) if isinstance(name, str) else []
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


class StageTableError(ValueError):
    """A line of the stage table that contradicts the table: raised when the table is built (at import)."""


class UnknownStageError(InputError, KeyError):
    """A stage name that is not in the table; the message names the nearest ones (a config error: not retried)."""

    def __str__(self) -> str:  # KeyError quotes its argument; the sentence reads better plain
        return str(self.args[0])


@dataclass(frozen=True)
class StageTable:
    """What the rest of the project reads off a table of stages."""

    specs: tuple[StageSpec, ...]

    def __post_init__(self) -> None:
        problems = [p for s in self.specs for p in self._problems(s)]
        names = [s.name for s in self.specs]
        problems += [f"stage {n!r} has {names.count(n)} lines" for n in dict.fromkeys(names) if names.count(n) > 1]
        if problems:
            raise StageTableError("the stage table (stages/core/stage_spec.py): " + "; ".join(problems))

    def _problems(self, line: StageSpec) -> list[str]:
        """What is wrong with `line` given the other lines: its targets' form, its part_of, its group."""
        names = [s.name for s in self.specs]
        targets = [("entry", line.entry), *(("check", c) for c in line.checks)]
        problems = [f"{line.name}: {what} {target!r} is not 'package.module:function'" for what, target in targets
                    if not _is_target(target)]
        if not line.key.isidentifier():
            problems.append(f"{line.name}: key {line.key!r} is not a function name")
        if line.retries < 0:
            problems.append(f"{line.name}: retries {line.retries} is negative")
        if line.part_of is not None:
            parent = next((s for s in self.specs if s.name == line.part_of), None)
            if parent is None:
                problems.append(f"{line.name}: part_of {line.part_of!r} names no stage{nearest(line.part_of, names)}")
            elif parent is line or not parent.selectable:
                problems.append(f"{line.name}: part_of {line.part_of!r} is not a stage selected on its own (a part "
                                "names the stage it runs with, never itself or another part)")
            if line.group:  # selected, refreshed and deployed with its parent: a deployment of its own contradicts it
                problems.append(f"{line.name}: a stage part_of {line.part_of!r} has no group ({line.group!r})")
        if line.group:
            others = {s.group for s in self.specs if s.group and s.group != line.group}
            if line.group in names:
                problems.append(f"{line.name}: group {line.group!r} is also a stage's name: `--only {line.group}` "
                                f"and the deployment stage-{line.group} would mean two things")
            elif [s.group for s in self.specs].count(line.group) < 2:  # one stage is selected by its own name
                problems.append(f"{line.name}: group {line.group!r} names no other stage (a group is several stages "
                                f"selected and deployed together, as stage-<group>){nearest(line.group, others)}")
        return problems

    @property
    def stages(self) -> tuple[str, ...]:
        """The selectable stages, in run order (`--only/--until/--refresh` names; DPO goes with SFT)."""
        return tuple(s.name for s in self.specs if s.selectable)

    @property
    def groups(self) -> dict[str, tuple[str, ...]]:
        groups: dict[str, tuple[str, ...]] = {}
        for s in self.specs:
            if s.group:
                groups[s.group] = (*groups.get(s.group, ()), s.name)
        return groups

    @property
    def isolatable(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.isolatable)

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.deployment for s in self.specs))

    @property
    def names_type(self) -> object:
        """The Literal of every name a selection takes (stages and groups): the flows' parameter type."""
        return Literal[self.stages + tuple(self.groups)]  # type: ignore[valid-type]

    def reading(self, section: str) -> tuple[str, ...]:
        """The stages whose inputs include the config section `section`."""
        return tuple(s.name for s in self.specs if section in s.sections)

    def checks(self, stages: set[str] | frozenset[str]) -> tuple[str, ...]:
        """The pre-flight checks the stages `stages` need, each once, in the order the table first names it."""
        return tuple(dict.fromkeys(c for s in self.specs if s.name in stages for c in s.checks))

    def checked_by(self, check: str) -> tuple[str, ...]:
        """The stages that need the pre-flight check `check`."""
        return tuple(s.name for s in self.specs if check in s.checks)

    def spec(self, name: str) -> StageSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise UnknownStageError(self.unknown(name))

    def unknown(self, name: object, selectable: bool = False) -> str:
        """What to say about a name that is not a stage (with `selectable`: not one a selection takes): the nearest
        names, then every name."""
        part = next((s for s in self.specs if s.name == name and not s.selectable), None) if selectable else None
        if part is not None:
            return f"stage {name!r} runs and refreshes as part of {part.part_of!r}: select {part.part_of!r}"
        known = (*self.stages, *self.groups) if selectable else tuple(s.name for s in self.specs)
        hint = nearest(name, known)
        groups = ", ".join(f"'{g}' for {'+'.join(members)}" for g, members in self.groups.items())
        return (f"unknown stage {name!r}{hint}; the stages are {', '.join(self.stages if selectable else known)}"
                + (f" (or {groups})" if selectable and groups else "") + " (stages/core/stage_spec.py)")


def _is_target(target: str) -> bool:
    module, sep, function = target.partition(":")
    return bool(sep) and function.isidentifier() and all(part.isidentifier() for part in module.split("."))


TABLE = StageTable(STAGE_SPECS)  # checked as it is built: a line that contradicts the others fails the import
SPECS: dict[str, StageSpec] = {s.name: s for s in STAGE_SPECS}
STAGES: tuple[str, ...] = TABLE.stages
GROUPS: dict[str, tuple[str, ...]] = TABLE.groups
StageName = TABLE.names_type  # the flows' parameter type, from the table
ISOLATABLE: tuple[str, ...] = TABLE.isolatable
DEPLOYMENTS: tuple[str, ...] = TABLE.deployments


def table() -> StageTable:
    """The stage table as it is now (read at call time, so a test that adds a line sees it everywhere)."""
    return TABLE


def spec(name: str) -> StageSpec:
    """The line of stage `name`; an unknown name raises UnknownStageError naming the nearest ones."""
    return table().spec(name)
