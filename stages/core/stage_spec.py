"""The stages of the pipeline, one line each: every other fact about a stage is derived from this table.

Derived from it: the stage order and the names `--only/--until/--refresh` take (stages.core.selection), the
`StageName` type of the flow parameters, which config sections' input files are checked before a run
(stages.core.input_check), which stages may run under another interpreter (run.interpreters), each stage task's
key function and output folder (tasks.common.stage_task: the folder under run.output_root is the stage's name), and
the `stage-<name>` deployments (prefect.yaml, diffed against this table by tests/unit/test_stage_spec.py).

Adding a stage: one line here, one wiring line in flows/pipeline.py, the stage's own package under stages/ (its
key function hashes `code_version(__name__)`), and its thin task in tasks/.

No stage module imports this table (a test holds that), so adding a stage leaves every other stage's key as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StageSpec:
    """name: the stage's name, its output folder under run.output_root and its Prefect task name.
    sections: the config sections it reads (their input files are checked before a run that includes it; its key
    may cover their models and no other section's). key: "module:function" of its key function (folder name and
    Prefect cache key). isolatable: may run under another interpreter (run.interpreters.<name>). part_of: a stage
    selected, refreshed and deployed with another (DPO belongs to SFT). group: the selection group it belongs to
    (`eval` = infer + score + report), which is also its deployment."""

    name: str
    sections: tuple[str, ...]
    key: str
    isolatable: bool = False
    part_of: str | None = None
    group: str | None = None

    @property
    def selectable(self) -> bool:
        return self.part_of is None

    @property
    def deployment(self) -> str:
        """The stage deployment that runs it alone (its upstream from cache)."""
        return f"stage-{self.group or self.part_of or self.name}"


STAGE_SPECS: tuple[StageSpec, ...] = (
    # data first: a bad data file fails in seconds, before a model is downloaded or converted
    StageSpec("data", ("data",), "stages.data.prepare:data_key"),
    StageSpec("bootstrap", ("model",), "stages.bootstrap.model:bootstrap_key"),
    StageSpec("sft", ("sft", "agent"), "stages.sft.stage:sft_key", isolatable=True),
    StageSpec("dpo", ("sft", "agent"), "stages.sft.dpo:dpo_key", isolatable=True, part_of="sft"),
    StageSpec("rl", ("rl", "agent"), "stages.rl.stage:rl_key", isolatable=True),
    StageSpec("merge", ("merge",), "stages.rl.merge:merge_key", isolatable=True),
    StageSpec("heldout", ("eval", "agent"), "stages.heldout.evaluate:heldout_key"),
    StageSpec("infer", ("eval", "agent", "serve"), "stages.eval.inference:infer_key", group="eval"),
    StageSpec("score", ("eval",), "stages.eval.scoring:scoring_key", group="eval"),
    StageSpec("report", ("eval",), "stages.eval.report:report_key", group="eval"),
)



@dataclass(frozen=True)
class StageTable:
    """What the rest of the project reads off a table of stages."""

    specs: tuple[StageSpec, ...]

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

    def reading(self, section: str) -> tuple[str, ...]:
        """The stages whose inputs include the config section `section`."""
        return tuple(s.name for s in self.specs if section in s.sections)


TABLE = StageTable(STAGE_SPECS)
SPECS: dict[str, StageSpec] = {s.name: s for s in STAGE_SPECS}
STAGES: tuple[str, ...] = TABLE.stages
GROUPS: dict[str, tuple[str, ...]] = TABLE.groups
StageName = Literal[STAGES + tuple(GROUPS)]  # type: ignore[valid-type]  # the flows' parameter type, from the table
ISOLATABLE: tuple[str, ...] = TABLE.isolatable
DEPLOYMENTS: tuple[str, ...] = TABLE.deployments


def spec(name: str) -> StageSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"no stage {name!r} in stages.core.stage_spec.STAGE_SPECS; stages are {list(SPECS)}") from None
