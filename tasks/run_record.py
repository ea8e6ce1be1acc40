from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from stages.core.config.loader import RunConfig, to_yaml
from stages.core.runs import finish_run, start_run
from stages.core.tracking.pipeline import finish_pipeline, start_pipeline
from tasks.artifacts import publish_markdown


@task(name="record-config", cache_policy=NO_CACHE)
def record_config_task(cfg: RunConfig, selection: str) -> str:
    """The run's folder and resolved config; the pipeline's run on the tracker (config `tracking`), handed to the
    stages through the environment (stages.core.tracking)."""
    run_dir = start_run(cfg, selection, run_id=str(flow_run.get_id() or ""))
    publish_markdown("resolved-config", f"Stages: `{selection}`\n\n```yaml\n{to_yaml(cfg)}```",
                     f"Resolved config of profile {cfg.profile}, also in {run_dir}/config.yaml")
    start_pipeline(cfg, run_dir, _card(cfg))
    return str(run_dir)


def _card(cfg: RunConfig) -> str | None:
    """The algorithm card (stages/rl/card.py) of a run that trains with RL: an artifact of the pipeline's run."""
    if not cfg.rl.enabled:
        return None
    from stages.rl.card import algorithm_card, card_markdown

    return card_markdown(algorithm_card(cfg.rl, cfg.agent))


@task(name="run-summary", cache_policy=NO_CACHE)
def summary_task(run_dir: str, refs: dict[str, Any]) -> dict[str, Any]:
    """refs.json and summary.md; the tracker's run gets the eval scores, links the cached stages and ends."""
    finish_pipeline(refs)
    summary = finish_run(run_dir, refs)
    publish_markdown("run-summary", (Path(run_dir) / "summary.md").read_text(), f"Outputs of this run: {run_dir}")
    return summary
