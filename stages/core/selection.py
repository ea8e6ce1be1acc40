"""Which stages a pipeline run executes and which it forces to recompute (the stage selection). Pure; the flow only
reads it. ("Plan" in this project means only `arpo plan`, the cost estimate: stages/cost.)

Stages run in the order of stages.core.stage_spec.STAGE_SPECS; `eval` names the evaluation group (infer + score +
report, served by one policy server).
- until=S: run the chain up to and including S.
- only=[S]: run S; its upstream still runs but is served from cache (it is needed for S's inputs).
- refresh=[S]: recompute S even if cached. Its downstream follows on its own: S's output fingerprint changes.
- refresh_from=S: recompute S and everything after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.errors import DeterministicError
from stages.core.stage_spec import GROUPS, STAGES, StageName

__all__ = ["GROUPS", "STAGES", "SelectionError", "StageName", "StageSelection", "expand", "select_stages"]


class SelectionError(ValueError, DeterministicError):
    pass


def expand(names: list[str] | tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for name in names:
        if name in GROUPS:
            out.extend(GROUPS[name])
        elif name in STAGES:
            out.append(name)
        else:
            groups = ", ".join(f"'{g}' for {'+'.join(members)}" for g, members in GROUPS.items())
            raise SelectionError(f"unknown stage {name!r}; stages are {list(STAGES)} (or {groups})")
    return out


@dataclass(frozen=True)
class StageSelection:
    run: frozenset[str]
    refresh: frozenset[str]

    def runs(self, stage: str) -> bool:
        return stage in self.run

    def refreshes(self, stage: str) -> bool:
        return stage in self.refresh

    def describe(self) -> str:
        order = [s for s in STAGES if s in self.run]
        return " -> ".join(f"{s}{' (refresh)' if s in self.refresh else ''}" for s in order)


def select_stages(only: list[str] | None = None, until: str | None = None, refresh: list[str] | None = None,
                  refresh_from: str | None = None) -> StageSelection:
    if only and until:
        raise SelectionError("use either `only` or `until`, not both")
    last = len(STAGES) - 1
    if until:
        last = max(STAGES.index(s) for s in expand([until]))
    if only:
        last = max(STAGES.index(s) for s in expand(only))
    run = set(STAGES[: last + 1])
    forced = set(expand(refresh or []))
    if refresh_from:
        first = min(STAGES.index(s) for s in expand([refresh_from]))
        forced |= set(STAGES[first:])
    return StageSelection(run=frozenset(run), refresh=frozenset(forced & run))
