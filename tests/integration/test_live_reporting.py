"""What a stage logs and reports reaches its Prefect task run, in-process and from a child interpreter: log lines with
their levels, the child's other output (noise summarised), a progress artifact updated to 100%, a markdown artifact
and an event; a DeterministicError is not retried; the eval table fills in as each benchmark is scored; an RL alarm in
rl.alarms.stop_on publishes its alert and event, then ends the stage once."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import pytest
from prefect import flow, task

from stages.core.config.loader import ConfigError, load_config
from stages.core.engine_spec import VERL_VERSION
from stages.core.refs import ScoresRef
from tasks.publish import scores_as_they_finish
from tasks.rl import publish_card, rl_task
from tasks.stage_tasks import call_stage, stage_task
from tests.conftest import PROJECT_ROOT

CACHE = PROJECT_ROOT / ".cache"

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


@task(task_run_name="count-{python_label}")
def count_task(n: int, python: str | None, python_label: str) -> int:
    return call_stage("tests.integration.live_stage:count", python, n=n)


@flow
def count_flow(python: str | None, label: str) -> str:
    state = count_task(3, python, label, return_state=True)
    return str(state.state_details.task_run_id)


def _read(task_run_id: str, want_events: int, prefix: str = "arpo.test") -> tuple[list, list, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterTaskRunId,
        LogFilter,
        LogFilterTaskRunId,
    )

    async def main():
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])))
            deadline = time.monotonic() + 300  # the server stores events in batches: a ceiling, not the wait
            while True:
                response = await client._client.post("/events/filter", json={"filter": {
                    "event": {"prefix": [prefix]},
                    "related": {"resources_in_roles": [[f"prefect.task-run.{task_run_id}", "task-run"]]}}})
                events = response.json()["events"]
                if len(events) >= want_events or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)
            return logs, artifacts, events

    return asyncio.run(main())


@pytest.mark.parametrize("python", [None, sys.executable], ids=["in-process", "child-interpreter"])
def test_stage_logs_progress_and_artifacts_reach_the_task_run(python) -> None:
    task_run_id = count_flow(python, "child" if python else "here")
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs and events go out in batches: wait for the last ones
    EventsWorker.drain_all()
    logs, artifacts, events = _read(task_run_id, want_events=1)
    lines = {(log.level, log.message) for log in logs}
    assert (logging.INFO, "counting 3 units") in lines
    assert (logging.WARNING, "careful: unit 3 is the last") in lines
    assert any(level == logging.INFO and message.startswith("count: 3/3 units (100%)") for level, message in lines)
    progress = [a for a in artifacts if a.type == "progress"]
    assert [(a.key, a.data) for a in progress] == [("progress-count", 100.0)]
    assert progress[0].description.startswith("finished: count: 3/3 units")
    assert [a.key for a in artifacts if a.type == "markdown"] == ["count-report"]
    assert [e["event"] for e in events] == ["arpo.test.counted"] and events[0]["payload"] == {"n": 3}
    if python:  # what the child printed: levels guessed, repeats and progress bars counted, not dropped
        assert (logging.INFO, "count output | plain library line") in lines
        assert (logging.WARNING, "count output | UserWarning: a library repeats itself") in lines
        summary = [m for _, m in lines if "not shown" in m]
        assert summary and "1 progress-bar refreshes" in summary[0] and "1 repeated lines" in summary[0]


attempts: list[int] = []


@stage_task("config-check", retries=2, retry_delay_seconds=0, off_table=True)
def failing_task(deterministic: bool) -> None:
    attempts.append(1)
    raise ConfigError("bad key") if deterministic else RuntimeError("flaky")


@flow
def failing_flow(deterministic: bool) -> str:
    return failing_task(deterministic, return_state=True).name


def test_a_deterministic_error_is_not_retried() -> None:
    attempts.clear()
    assert failing_flow(True) == "Failed" and len(attempts) == 1
    attempts.clear()
    assert failing_flow(False) == "Failed" and len(attempts) == 3   # 1 + 2 retries


@task
def scored(benchmark: str, accuracy: float) -> ScoresRef:
    meta = {"questions": 2, "samples_per_question": 1, "accuracy_metric": "em",
            "metrics": {"accuracy": {"value": accuracy, "ci_low": 0.0, "ci_high": 1.0}}}
    return ScoresRef(path=f"/scores/{benchmark}", fingerprint=benchmark, benchmark=benchmark, meta=meta)


@flow
def two_benchmarks() -> tuple[list[ScoresRef], str]:
    from prefect.runtime import flow_run

    futures = [scored.submit("gsm8k", 0.5), scored.submit("hotpotqa", 0.25)]
    return scores_as_they_finish(["gsm8k", "hotpotqa"], futures), str(flow_run.get_id())


def test_the_eval_table_fills_in_per_benchmark() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    refs, run_id = two_benchmarks()
    assert [r.benchmark for r in refs] == ["gsm8k", "hotpotqa"]          # in the configured order

    async def versions():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["eval-scores"]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))

    tables = sorted(asyncio.run(versions()), key=lambda a: a.created)
    # one version per finished benchmark: the first shows one scored row and one still running, the last both
    assert [a.description for a in tables] == ["1/2 benchmarks scored", "2/2 benchmarks scored"]
    first, last = (json.loads(a.data) for a in tables)
    assert sorted(row["status"] for row in first) == ["running", "scored"]
    assert [(row["benchmark"], row["accuracy"]) for row in last] == [("gsm8k", 50.0), ("hotpotqa", 25.0)]


def test_an_alarm_in_stop_on_ends_rl_once_after_its_alert(tiny_model, synthetic_data, tmp_path) -> None:
    # entropy (normalised, <= 1) is always under a floor of 10: entropy_collapse fires at step 1 and, being in
    # stop_on, ends the stage before step 1 is saved; the rl task (retries=1) must not run it again
    cfg = load_config("tiny-cpu", ["rl.rollout.n=2", "rl.rollout.initial_rollouts=1", "rl.trainer.train_batch_size=1",
                                   "rl.trainer.ppo_mini_batch_size=1", "rl.trainer.micro_batch_size=2",
                                   "rl.rollout.max_response_length=16", "rl.rollout.call_limit=1",
                                   "rl.trainer.total_steps=2", "rl.alarms.entropy_floor=10",
                                   "rl.alarms.stop_on=[entropy_collapse]"])

    @flow
    def rl_flow() -> tuple[str, str]:
        state = rl_task(cfg.rl, cfg.agent, tiny_model, synthetic_data, str(tmp_path), str(CACHE), return_state=True)
        return state.name, str(state.state_details.task_run_id)

    state, task_run_id = rl_flow()
    assert state == "Failed"
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()

    async def run_count():
        async with get_client() as client:
            return (await client.read_task_run(task_run_id)).run_count

    assert asyncio.run(run_count()) == 1
    # (the untrained tiny policy may also get tool_unused at step 1: a warning, not in stop_on)
    _, artifacts, events = _read(task_run_id, want_events=1, prefix="arpo.rl.alarm.entropy_collapse")
    card = next(a for a in artifacts if a.key == "rl-algorithm-card")   # published before the stage ran
    assert {row["mechanism"]: row["verdict"] for row in json.loads(card.data)}["branch rule"] == "same"
    alert = next(a for a in artifacts if a.key == "rl-alarms")
    assert "| 1 | **entropy_collapse** |" in alert.data and "| stop |" in alert.data
    assert [(e["event"], e["payload"]["stops_run"]) for e in events] == [("arpo.rl.alarm.entropy_collapse", True)]
    stage = next((tmp_path / "rl").iterdir())
    assert "# Algorithm card: arpo on the local engine" in (stage / "algorithm_card.md").read_text()
    assert not list((stage / "checkpoints").glob("step_*"))       # the alarmed step was not saved
    assert (stage / "trees" / "step_000001.html").is_file()         # but its rollout trees are there to look at
    assert [n for line in (stage / "alarms.jsonl").read_text().splitlines()
            if (n := json.loads(line)["name"]) != "tool_unused"] == ["entropy_collapse"]


@task
def card_task(profile: str) -> None:
    publish_card(load_config(profile).rl)


def test_the_algorithm_card_of_the_verl_config_reaches_the_ui() -> None:
    # the RL task publishes the card before calling the stage; for rl.engine verl it is read back from the verl
    # overrides (stages/rl/card.py), so it needs no verl here
    @flow
    def card_flow() -> str:
        return str(card_task("aepo-qwen3-14b-deepsearch", return_state=True).state_details.task_run_id)

    _, artifacts, _ = _read(card_flow(), want_events=0)
    (card,) = [a for a in artifacts if a.key == "rl-algorithm-card"]
    rows = {row["mechanism"]: row for row in json.loads(card.data)}
    assert f"read back from the verl {VERL_VERSION} overrides" in rows["engine"]["this run"]
    assert rows["entropy-aware advantage"]["verdict"] == "differs" and "aepo on the verl engine" in card.description
