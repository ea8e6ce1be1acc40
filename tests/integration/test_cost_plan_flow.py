"""The pre-launch estimate at flow start: the pipeline's `cost-plan` task writes plan.md / plan.json into the run
record and publishes the same markdown as a Prefect artifact (the arithmetic: tests/unit/test_cost_plan.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prefect import flow

from stages.core.config.loader import load_config
from tasks.cost import cost_plan_task

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


@flow
def plan_first(cfg, run_dir: str) -> dict:
    return cost_plan_task(cfg, run_dir)


def test_the_plan_is_published_and_recorded(tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    cfg = load_config("tiny-cpu", [f"run.output_root={tmp_path / 'out'}", "cost.step_seconds=130"])
    estimate = plan_first(cfg, str(tmp_path))
    assert estimate["steps"] == 2 and json.loads((tmp_path / "plan.json").read_text()) == estimate
    markdown = (tmp_path / "plan.md").read_text()
    assert markdown.startswith("## Plan: profile tiny-cpu, 2 RL steps") and "| device-hours |" in markdown

    async def published() -> list[str]:
        async with get_client() as client:
            return [a.data for a in await client.read_artifacts() if a.key == "cost-plan"]

    assert markdown in asyncio.run(published())
