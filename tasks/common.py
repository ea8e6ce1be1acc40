"""What every stage task shares: the one cache key, retries, and how a forced refresh is applied.

One key per stage: the Prefect cache key of a stage task is the stage's own key function (the one that names its
output folder, e.g. `stages.eval.inference.infer_key`) called on the task's inputs, plus where the folder lives
(`output_root`). The folder and the Prefect cache therefore change together: whatever changes the folder key
(a config field the stage reads, an upstream fingerprint, the stage's code, what an endpoint serves) recomputes
the task, and nothing else does (not the endpoint's URL, the interpreter it runs under, the cache root).

Refresh is one switch: `refresh_cache` on the task run (`run_stage` sets it for a refreshed stage). Prefect then
runs the task and overwrites its cache entry, and the task passes `force=forced()` to the stage, which wipes its
folder and recomputes.

Retries are for transient failures only: a stage raising `stages.core.errors.InputError` (bad config, missing
or malformed data) fails at once, since the same inputs would fail the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE
from prefect.states import State

from stages.core.errors import DeterministicError
from stages.core.fingerprint import hash_value
from tasks import live

live.install()  # stage log lines and progress reach the current Prefect run

R = TypeVar("R")
KeyFn = Callable[..., str]


@dataclass
class StageKey(CachePolicy):
    """The stage's own key function on the task's inputs (those it names), and the output root."""

    stage: str = ""
    key_fn: KeyFn | None = None

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str:
        return stage_key(self.stage, self.key_fn, inputs)


def stage_key(stage: str, key_fn: KeyFn, inputs: dict[str, Any]) -> str:
    """The Prefect cache key of a stage task with these inputs."""
    wanted = inspect.signature(key_fn).parameters
    key = key_fn(**{name: value for name, value in inputs.items() if name in wanted})
    return hash_value(stage, key, str(Path(inputs["output_root"]).resolve()))


def forced() -> bool:
    """Whether this task run recomputes (its `refresh_cache`, else PREFECT_TASKS_REFRESH_CACHE): the stage is then
    called with force=True and wipes its folder first."""
    ctx = TaskRunContext.get()
    flag = ctx.task.refresh_cache if ctx is not None else None
    return bool(PREFECT_TASKS_REFRESH_CACHE.value() if flag is None else flag)


def retryable(task_: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect `retry_condition_fn`: retry unless the error says the same inputs fail again (a config or data
    error, an alarm in rl.alarms.stop_on)."""
    failure = state.data
    if isinstance(failure, State):  # the task returned a failed state instead of raising
        failure = failure.data
    return not isinstance(failure, DeterministicError)


def stage_task(stage: str, key: KeyFn | None = None, retries: int = 1, retry_delay_seconds: float = 5,
               tags: tuple[str, ...] = (), timeout_seconds: float | None = None) -> Callable[[Callable[..., R]], Task]:
    """Decorator for a stage task: cached on the stage's key function `key` (no cache without one), results
    persisted, idempotent so retried (unless the error is a DeterministicError)."""
    policy = StageKey(stage=stage, key_fn=key) if key is not None else NO_CACHE
    return task(name=stage, cache_policy=policy, persist_result=key is not None, retries=retries,
                retry_delay_seconds=retry_delay_seconds, tags=list(tags), timeout_seconds=timeout_seconds,
                task_run_name=f"{stage}", retry_condition_fn=retryable)


def refreshed(stage_task_: Task, refresh: bool) -> Task:
    """The same task, recomputing and overwriting its cache entry when `refresh` is set."""
    return stage_task_.with_options(refresh_cache=True) if refresh else stage_task_


def call_stage(target: str, python: str | None, **kwargs: Any) -> Any:
    """Call a stage entry point ('stages.x.mod:fn') here, or under another interpreter when `python` is set."""
    if python:
        from stages.core.isolate import call_in_interpreter

        return call_in_interpreter(python, target, kwargs)
    from stages.core.isolate import resolve

    return resolve(target)(**kwargs)


def run_stage(stage_task_: Task, plan: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
    """Call a stage task, recomputing it (cache entry overwritten, stage folder wiped) when the plan says so."""
    return refreshed(stage_task_, plan.refreshes(stage))(*args, **kwargs)


def submit_stage(stage_task_: Task, plan: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
    """Like run_stage, but submitted to the flow's task runner (for fan-out); returns a future."""
    return refreshed(stage_task_, plan.refreshes(stage)).submit(*args, **kwargs)
