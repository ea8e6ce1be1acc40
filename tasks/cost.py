"""The pre-launch estimate as the flow's first artifact (`arpo plan` prints the same): never cached, it reads the
measured runs on disk now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.core.atomic import write_json, write_text
from stages.core.config.loader import RunConfig
from stages.cost import plan_run, render_markdown
from tasks.artifacts import publish_markdown


@task(name="cost-plan", cache_policy=NO_CACHE)
def cost_plan_task(cfg: RunConfig, run_dir: str) -> dict[str, Any]:
    estimate = plan_run(cfg)
    markdown = render_markdown(estimate)
    write_text(Path(run_dir) / "plan.md", markdown)
    write_json(Path(run_dir) / "plan.json", estimate.to_json())
    publish_markdown("cost-plan", markdown, f"What this run will cost (profile {cfg.profile}; {run_dir}/plan.md)")
    return estimate.to_json()
