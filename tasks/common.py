"""What every stage task shares: the cache policy, retries, and how a forced refresh is applied.

Cache key = hash(task inputs except `force`) + hash(stage name, code version of the packages the stage runs).
Inputs are config sections (frozen pydantic) and refs (paths + fingerprints), so changing a section or an
upstream output changes the key, and so does editing any module of the stage's packages.

Retries are for transient failures only: a stage raising `stages.core.errors.InputError` (bad config, missing
or malformed data) fails at once, since the same inputs would fail the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prefect import Task, task
from prefect.cache_policies import INPUTS, CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.states import State

from stages.core.errors import DeterministicError
from stages.core.fingerprint import code_version, hash_value
from tasks import live

live.install()  # stage log lines and progress reach the current Prefect run

R = TypeVar("R")


@dataclass
class StageCode(CachePolicy):
    """Keys on the stage name and the source of every module in the named packages."""

    stage: str = ""
    packages: tuple[str, ...] = field(default_factory=tuple)

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str:
        return hash_value(self.stage, code_version(*self.packages))


@dataclass
class SectionFields(CachePolicy):
    """Keys on some fields of one config-section input, so settings a stage never reads do not invalidate it."""

    arg: str = ""
    fields: frozenset[str] = frozenset()

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str:
        return hash_value(self.arg, inputs[self.arg].model_dump(include=set(self.fields)))


def stage_cache(stage: str, *packages: str) -> CachePolicy:
    # `force` says whether to recompute and `python` where to run: neither changes what the stage computes
    return (INPUTS - "force" - "python") + StageCode(stage=stage, packages=("stages.core", *packages))


def retryable(task_: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect `retry_condition_fn`: retry unless the error says the same inputs fail again (a config or data
    error, an alarm in rl.alarms.stop_on)."""
    failure = state.data
    if isinstance(failure, State):  # the task returned a failed state instead of raising
        failure = failure.data
    return not isinstance(failure, DeterministicError)


def stage_task(stage: str, *packages: str, retries: int = 1, retry_delay_seconds: float = 5,
               tags: tuple[str, ...] = (), timeout_seconds: float | None = None) -> Callable[[Callable[..., R]], Task]:
    """Decorator for a stage task: cached by `stage_cache`, results persisted, idempotent so retried (unless the
    error is a DeterministicError)."""
    return task(name=stage, cache_policy=stage_cache(stage, *packages), persist_result=True, retries=retries,
                retry_delay_seconds=retry_delay_seconds, tags=list(tags), timeout_seconds=timeout_seconds,
                task_run_name=f"{stage}", retry_condition_fn=retryable)


def refreshed(stage_task_: Task, refresh: bool) -> Task:
    """The same task, forced to recompute and overwrite its cache entry when `refresh` is set."""
    return stage_task_.with_options(refresh_cache=True) if refresh else stage_task_


def call_stage(target: str, python: str | None, **kwargs: Any) -> Any:
    """Call a stage entry point ('stages.x.mod:fn') here, or under another interpreter when `python` is set."""
    if python:
        from stages.core.isolate import call_in_interpreter

        return call_in_interpreter(python, target, kwargs)
    from stages.core.isolate import resolve

    return resolve(target)(**kwargs)


def run_stage(stage_task_: Task, plan: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
    """Call a stage task, forcing a recompute (cache refresh + stage folder wipe) when the plan says so."""
    force = plan.refreshes(stage)
    return refreshed(stage_task_, force)(*args, force=force, **kwargs)


def submit_stage(stage_task_: Task, plan: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
    """Like run_stage, but submitted to the flow's task runner (for fan-out); returns a future."""
    force = plan.refreshes(stage)
    return refreshed(stage_task_, force).submit(*args, force=force, **kwargs)
