"""Prefect tasks around a rehearsal (stages/rehearse/run.py): prepare before the pipeline subflow, report after."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.rehearse.rule import Offline
from stages.rehearse.run import Prepared, finish, prepare
from tasks.artifacts import publish_markdown


@task(name="rehearsal-prepare", cache_policy=NO_CACHE)
def rehearsal_prepare_task(profile: str, overrides: list[str], offline: Offline, stages: list[str]) -> Prepared:
    prepared = prepare(profile, overrides, offline, stages)
    publish_markdown("rehearsal-changes", prepared.rehearsal.table(),
                     f"What the rehearsal of {profile} changes (stages/rehearse/rule.py)")
    return prepared


@task(name="rehearsal-report", cache_policy=NO_CACHE)
def rehearsal_report_task(prepared: Prepared, summary: dict[str, Any]) -> str:
    path = finish(prepared, summary)
    publish_markdown("rehearsal", path.read_text(), f"Rehearsal report, also in {path}")
    return str(path)
