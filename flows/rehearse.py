"""The `arpo-rehearse` flow (deployment `rehearse`): a paper profile end to end at toy scale (docs/rehearse.md).
Wiring only: prepare (the rule's changes, the toy model, the checks), the ordinary pipeline as a subflow with the
rehearsal's overrides, the report."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow

from flows.pipeline import pipeline
from stages.core.config.loader import Override, Profile
from stages.core.selection import StageName, select_stages
from stages.rehearse.rule import Offline
from tasks.rehearse import rehearsal_prepare_task, rehearsal_report_task


@flow(name="arpo-rehearse", log_prints=True)
def rehearse(profile: Profile = "arpo-qwen2.5-7b-reasoning", overrides: list[Override] | None = None,
             search_replay: str | None = None, page_replay: str | None = None, engine: str | None = None,
             judge: Literal["rule", "policy"] = "rule", until: StageName | None = None,
             toy_policy: Literal["random", "tool_caller"] = "random") -> dict[str, Any]:
    """profile: the profile to rehearse; overrides: key.sub=value, applied before the rehearsal's changes;
    search_replay / page_replay: recorded search results / pages standing in for the network; engine: local | verl
    instead of the profile's; judge: rule (rule metrics only) or policy (the served toy policy judges); until: the
    last stage to run; toy_policy: random, or tool_caller (a toy whose weights call the tools)."""
    selection = select_stages([], until, [], None)
    offline = Offline(search_replay, page_replay, engine, judge, toy_policy)
    prepared = rehearsal_prepare_task(profile, overrides or [], offline, list(selection.run))
    summary = pipeline(profile=profile, overrides=prepared.overrides, until=until)
    return {**summary, "rehearsal": rehearsal_report_task(prepared, summary)}
