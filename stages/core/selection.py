"""Which stages a pipeline run executes and which it forces to recompute (the stage selection). Pure; the flow only
reads it. ("Plan" in this project means only `arpo plan`, the cost estimate: stages/cost.)

Stages run in the order of stages.core.stage_spec.STAGE_SPECS; `eval` names the evaluation group (infer + score +
report, served by one policy server).
- until=S: run the chain up to and including S.
- only=[S]: run S; its upstream still runs but is served from cache (it is needed for S's inputs).
- refresh=[S]: recompute S even if cached. Its downstream follows on its own: S's output fingerprint changes.
- refresh_from=S: recompute S and everything after it.

Every name is checked against the table: a misspelled one fails with the nearest names, whether it comes from the
command line or from code asking `selection.runs("infr")`.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.errors import DeterministicError, InputError
from stages.core.stage_spec import GROUPS, STAGES, StageName, StageSpec, table

__all__ = ["GROUPS", "STAGES", "SelectionError", "StageName", "StageSelection", "expand", "select_stages"]


class SelectionError(ValueError, DeterministicError):
    pass


class UnknownStageName(SelectionError, InputError):
    """A selection names no stage or group of the table; the message names the nearest ones."""


def expand(names: list[str] | tuple[str, ...]) -> list[str]:
    stages, groups = table().stages, table().groups
    out: list[str] = []
    for name in names:
        if name in groups:
            out.extend(groups[name])
        elif name in stages:
            out.append(name)
        else:
            raise UnknownStageName(table().unknown(name, selectable=True))
    return out


@dataclass(frozen=True)
class StageSelection:
    run: frozenset[str]
    refresh: frozenset[str]

    def runs(self, stage: str) -> bool:
        return _selected_as(stage) in self.run

    def refreshes(self, stage: str | StageSpec) -> bool:
        """Whether `stage` (a name, or its line: no lookup) recomputes (a stage that belongs to another, DPO to SFT,
        follows it)."""
        return (stage.selected_as if isinstance(stage, StageSpec) else _selected_as(stage)) in self.refresh

    def describe(self) -> str:
        order = [s for s in table().stages if s in self.run]
        return " -> ".join(f"{s}{' (refresh)' if s in self.refresh else ''}" for s in order)


def _selected_as(stage: str) -> str:
    try:
        return table().spec(stage).selected_as
    except KeyError:
        raise UnknownStageName(table().unknown(stage)) from None


def select_stages(only: list[str] | None = None, until: str | None = None, refresh: list[str] | None = None,
                  refresh_from: str | None = None) -> StageSelection:
    if only and until:
        raise SelectionError("use either `only` or `until`, not both")
    stages = table().stages
    last = len(stages) - 1
    if until:
        last = max(stages.index(s) for s in expand([until]))
    if only:
        last = max(stages.index(s) for s in expand(only))
    run = set(stages[: last + 1])
    forced = set(expand(refresh or []))
    if refresh_from:
        first = min(stages.index(s) for s in expand([refresh_from]))
        forced |= set(stages[first:])
    return StageSelection(run=frozenset(run), refresh=frozenset(forced & run))
