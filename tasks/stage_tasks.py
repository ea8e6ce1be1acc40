"""The stage tasks: how a stage's Prefect task is made and called. What every stage task shares: the one cache key,
retries, how a forced refresh is applied, and the stage table's line, which the task holds.

Built from the table (stages/core/stage_spec.py): `entry_task("<stage>")` is a stage's task, made from its line:
the entry point's parameters, cached on the key function the line names, then the hook the task layer registered
for the stage (`@publishes("<stage>")`, tasks/publish.py); adding a stage: CONTRIBUTING.md, "Adding a stage".
`stage_task("<stage>")` is the decorator underneath (a name not in the table raises, naming the nearest ones), whose
body calls `call_entry(...)`, the line's entry point, here or under the interpreter the task is given. The task
holds its line (`line_of(task)`): the flow calls each task through `StageRunner`, which reads the line off the task
and fills in its refresh, the output and cache roots and, for a task that may run under another interpreter,
`python`. One stage call looks its line up once, where the flow names the stage.

One key per stage: the Prefect cache key of a stage task is the stage's own key function (the one that names its
output folder, e.g. `stages.eval.inference.infer_key`) called on the task's inputs, plus where the folder lives
(`output_root`). The folder and the Prefect cache therefore change together: whatever changes the folder key
(a config field the stage reads, an upstream fingerprint, the stage's code, what an endpoint serves) recomputes
the task, and nothing else does (not the endpoint's URL, the interpreter it runs under, the cache root).

Refresh is one switch: `refresh_cache` on the task run (`run_stage` sets it for a refreshed stage). Prefect then
runs the task and overwrites its cache entry, and the task passes `force=forced()` to the stage, which wipes its
folder and recomputes.

Retries are for transient failures only: a stage raising `stages.core.errors.InputError` (bad config, missing
or malformed data) fails at once, since the same inputs would fail the same way, and its log line is
`error: <message>` (no traceback); a key function that raises one (fingerprinting a missing file) leaves the key
unset quietly and the stage raises it again before any work.

A cache hit serves only what is still there: before Prefect looks its key up, `StageKey` checks the stage's folder
against its manifest (sizes, small files' contents; every file's content when the flow runs with `verify=True`,
`arpo run --verify`). A damaged folder is wiped with a warning naming the files, a vanished one is named too, and
either way the cached entry is expired, so the task runs and rebuilds it instead of handing it downstream.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE
from prefect.states import State

from stages.core import locks
from stages.core.errors import DeterministicError, InputError
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.refs import Ref
from stages.core.selection import StageSelection
from stages.core.stage_spec import StageSpec, spec
from stages.core.workspace import MARKER, discard_if_damaged, stage_path, verify
from tasks import live

live.install()  # stage log lines and progress reach the current Prefect run
log = get_logger(__name__)

R = TypeVar("R")
TORCH_THREADS_ENV = "ARPO_TORCH_THREADS"  # set by `arpo run` (flows/launch.py), applied by apply_torch_threads
KeyFn = Callable[..., str]


@dataclass
class StageKey(CachePolicy):
    """The stage's own key function on the task's inputs (those it names), and the output root. The function is
    `key_fn`, or the table's `target` ("module:function"), imported when the first key is computed: importing a
    task module imports no stage code."""

    stage: str = ""
    key_fn: KeyFn | None = None
    target: str = ""
    line: StageSpec | None = None  # the table's line of the stage (None for a task off the table)

    @property
    def function(self) -> KeyFn:
        if self.key_fn is None:
            from stages.core.isolate import resolve

            self.key_fn = resolve(self.target)
        return self.key_fn

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        try:
            folder_key = self.function(**_wanted(self.function, inputs))
        except InputError:
            return None  # the stage computes its key first thing and raises this again: the task fails once
        key = cache_key(self.stage, folder_key, inputs["output_root"])
        check_cached(getattr(task_ctx, "result_store", None), key, self.stage,
                     stage_path(inputs["output_root"], self.stage, folder_key),
                     full=bool((flow_parameters or {}).get("verify")))
        return key


def _wanted(key_fn: KeyFn, inputs: dict[str, Any]) -> dict[str, Any]:
    wanted = inspect.signature(key_fn).parameters
    return {name: value for name, value in inputs.items() if name in wanted}


def cache_key(stage: str, folder_key: str, output_root: str) -> str:
    """The Prefect cache key of a stage task: its folder key and where the folder lives."""
    return hash_value(stage, folder_key, str(Path(output_root).resolve()))


def check_cached(store: Any, key: str, stage: str, folder: Path, full: bool = False) -> None:
    """Expire the cache entry `key` when what it points at is not what the stage wrote: the folder is damaged (wiped
    here, with a warning naming the files), gone, or rebuilt since (another fingerprint)."""
    if verify(folder, full):
        locks.acquire(folder)  # not while another run rebuilds it
        try:
            damaged = discard_if_damaged(folder, stage, full)
        finally:
            locks.release(folder)
        if damaged and store is not None:
            expire(store, key)
        return
    ref = _cached_ref(store, key) if store is not None else None
    if ref is None or not Path(ref.path).resolve().is_relative_to(folder):
        return  # nothing cached, or an output that is not this folder (a stage switched off hands its input on)
    if not (folder / MARKER).is_file():
        log.warning("cached output of stage %s is gone (%s); recomputing it", stage, folder)
        expire(store, key)
    elif ref.fingerprint != _marker_fingerprint(folder):
        log.info("stage %s: %s was rebuilt since it was cached; using the folder's own output", stage, folder)
        expire(store, key)


def _cached_ref(store: Any, key: str) -> Ref | None:
    try:
        value = store.read(key).result if store.exists(key) else None
    except Exception:  # noqa: BLE001 - any unreadable entry is a miss for Prefect too
        return None
    return value if isinstance(value, Ref) else None


def _marker_fingerprint(folder: Path) -> str | None:
    import json

    try:
        return json.loads((folder / MARKER).read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def expire(store: Any, key: str) -> None:
    """Make the entry a miss (an expired record in its place); the task's new result overwrites it."""
    store.write(obj=None, key=key, expiration=datetime.now(UTC) - timedelta(seconds=1))


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


def stage_task(stage: str | StageSpec, key: KeyFn | None = None, retries: int = 1, retry_delay_seconds: float = 5,
               tags: tuple[str, ...] = (), timeout_seconds: float | None = None,
               off_table: bool = False) -> Callable[[Callable[..., R]], Task]:
    """Decorator for the task of the stage `stage` (a line of stages.core.stage_spec.STAGE_SPECS, or its name: a
    name not in the table raises, naming the nearest ones): cached on the key function the table names, results
    persisted, idempotent so retried (unless the error is a DeterministicError). The task's name is the stage's, as
    is its output folder; its body calls the stage's entry point with `call_entry`. `off_table` is for a task
    outside the table (a test's probe): cached on `key` when given, else not cached."""
    line = None if off_table else stage if isinstance(stage, StageSpec) else spec(stage)
    name = line.name if line is not None else str(stage)
    if line is None:
        policy: CachePolicy = StageKey(stage=name, key_fn=key) if key is not None else NO_CACHE
    else:
        policy = StageKey(stage=name, key_fn=key, target=line.key_target, line=line)

    def decorate(fn: Callable[..., R]) -> Task:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> R:
            apply_torch_threads()
            running = _RUNNING.set(line)
            try:
                return fn(*args, **kwargs)
            finally:
                _RUNNING.reset(running)
                locks.release_thread_locks()  # a stage that failed before finishing its folder lets go of it

        return task(name=name, cache_policy=policy, persist_result=policy is not NO_CACHE, retries=retries,
                    retry_delay_seconds=retry_delay_seconds, tags=list(tags), timeout_seconds=timeout_seconds,
                    task_run_name=name, retry_condition_fn=retryable)(run)

    return decorate


# the line of the stage task running in this thread (set by stage_task's wrapper): what call_entry calls
_RUNNING: contextvars.ContextVar[StageSpec | None] = contextvars.ContextVar("running_stage", default=None)


def line_of(stage_task_: Task) -> StageSpec | None:
    """The table's line a stage task was built from (None for a task off the table)."""
    policy = stage_task_.cache_policy
    return policy.line if isinstance(policy, StageKey) else None


def apply_torch_threads() -> None:
    """torch's intra-op threads for the stages running in this process, as `arpo run` chose them at start
    (run.torch_threads, else the cores free then: flows/launch.py). Applied when a stage task first runs rather
    than at start, so a fully cached run never imports torch."""
    wanted = os.environ.get(TORCH_THREADS_ENV)
    if wanted:
        import torch

        if torch.get_num_threads() != int(wanted):
            torch.set_num_threads(int(wanted))


class InputErrorLines(logging.Filter):
    """Prefect logs a failed task or flow with its traceback. For an error the same inputs raise again (a config
    or data error, a stop-on alarm) the line becomes `error: <message>`, as `arpo run` prints it: no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, DeterministicError):
            record.msg, record.args, record.exc_info, record.exc_text = f"error: {exc}", (), None, None
        return True


for _name in ("prefect.task_runs", "prefect.flow_runs"):
    if not any(isinstance(f, InputErrorLines) for f in logging.getLogger(_name).filters):
        logging.getLogger(_name).addFilter(InputErrorLines())


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


def call_entry(python: str | None = None, force: bool | None = None, **kwargs: Any) -> Any:
    """Call the running stage task's entry point (its line's `entry`) with `kwargs` and `force` (default: whether
    this task run recomputes, `forced()`), here or under the interpreter `python`."""
    line = _RUNNING.get()
    if line is None:
        raise RuntimeError("call_entry runs inside the task of a stage in the table (tasks.stage_tasks.stage_task)")
    return call_stage(line.entry, python, **kwargs, force=forced() if force is None else force)


def entry_task(stage: str, label: str | None = None) -> Task:
    """The task of stage `stage`, built from its line: the entry's parameters (without `force`; with `python` when
    the stage may run under another interpreter), cached on the line's key function, retried `retries` times; once
    the entry returns, the stage's publish hook (tasks/publish.py) gets the result and the inputs it names. `label`
    names the task run `<stage>-<label>` (`heldout-sft`: the flow runs heldout once per policy) and is in no key."""
    built = _entry_task(spec(stage))
    return built.with_options(task_run_name=f"{stage}-{label}") if label else built


@functools.cache
def _entry_task(line: StageSpec) -> Task:
    """One task per line (a line that changes, as a test's does, gets its own)."""
    from stages.core.isolate import resolve
    from tasks.publish import HOOKS
    from tasks.secrets import export_search_key

    publish = HOOKS.get(line.name)  # checked against the entry when registered (tasks/publish.py)
    params = [p for name, p in inspect.signature(resolve(line.entry)).parameters.items() if name != "force"]
    if line.isolatable:
        params.append(inspect.Parameter("python", inspect.Parameter.KEYWORD_ONLY, default=None))

    signature = inspect.Signature(params)

    def run_entry(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        inputs = bound.arguments
        if "agent" in line.sections and "agent" in inputs:
            export_search_key(inputs["agent"])  # as every task of a stage that runs the agent's tools
        result = call_stage(line.entry, inputs.pop("python", None), **inputs, force=forced())
        if publish is not None:
            publish(inputs, result)
        return result

    run_entry.__signature__ = signature  # type: ignore[attr-defined]  # the task's parameters are the entry's
    run_entry.__name__ = run_entry.__qualname__ = f"{line.name}_task"
    return stage_task(line, retries=line.retries)(run_entry)


def run_stage(stage_task_: Task, selection: StageSelection, *args: Any, **kwargs: Any) -> Any:
    """Call a stage task, recomputing it (cache entry overwritten, stage folder wiped) when the stage selection
    refreshes its stage (read off the task: its line)."""
    return refreshed(stage_task_, _refreshes(selection, stage_task_))(*args, **kwargs)


def submit_stage(stage_task_: Task, selection: StageSelection, *args: Any, **kwargs: Any) -> Any:
    """Like run_stage, but submitted to the flow's task runner (for fan-out); returns a future."""
    return refreshed(stage_task_, _refreshes(selection, stage_task_)).submit(*args, **kwargs)


def _refreshes(selection: StageSelection, stage_task_: Task) -> bool:
    line = line_of(stage_task_)
    return selection.refreshes(line if line is not None else stage_task_.name)


@dataclass(frozen=True)
class StageRunner:
    """The stage tasks of one pipeline run, one call each: the stage is read off the task (its name), recomputed
    when the selection refreshes it, and given the run-level inputs its task takes and the call leaves out:
    `output_root` and `cache_root` (run.output_root, run.cache_root) and, for a task that takes one (a stage the
    table lets run under another interpreter), `python` (run.interpreters)."""

    selection: StageSelection
    run_section: Any  # stages.core.config.run.RunSection

    def run(self, stage_task_: Task, *args: Any, **kwargs: Any) -> Any:
        return run_stage(stage_task_, self.selection, *args, **self._inputs(stage_task_, kwargs))

    def submit(self, stage_task_: Task, *args: Any, **kwargs: Any) -> Any:
        return submit_stage(stage_task_, self.selection, *args, **self._inputs(stage_task_, kwargs))

    def _inputs(self, stage_task_: Task, kwargs: dict[str, Any]) -> dict[str, Any]:
        run = {"output_root": self.run_section.output_root, "cache_root": self.run_section.cache_root,
               "python": self.run_section.python_for(stage_task_.name)}  # taken only by a task that may move
        takes = inspect.signature(stage_task_.fn).parameters
        return {**{k: v for k, v in run.items() if k in takes}, **kwargs}
