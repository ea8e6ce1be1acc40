"""What the stage tasks publish to the Prefect UI once their entry point returns, and the `eval-scores` table the flow
republishes while the benchmarks are scored.

A stage's hook is registered here with `@publishes("<stage>")`: `tasks.stage_tasks.entry_task` calls it with the entry's
result and, as keywords, the entry inputs the hook names (its keyword-only parameters). Those names are checked when
this module loads against the parameters of the entry point the stage's line names (stages/core/stage_spec.py), so
renaming an entry parameter a hook reads fails the import, not a finished run. A hook runs only for the task its
line builds: a task written by hand publishes in its own body.

A hook only reads what the stage returned and its inputs: the stage's folder is finished before the hook runs, so a
hook that fails fails the task, and its retry or rerun finds the folder complete and publishes without redoing work."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect.futures import PrefectFuture, as_completed

from stages.core.config.data import DataSection
from stages.core.config.merge import MergeSection
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef, Ref, ScoresRef
from stages.core.stage_spec import StageTableError, spec
from tasks.artifacts import publish_image, publish_markdown, publish_table


@dataclass(frozen=True)
class PublishHook:
    """A stage's hook: `fn(result, **{name: inputs[name] for name in inputs})`."""

    stage: str
    fn: Callable[..., None]
    inputs: tuple[str, ...]

    def __call__(self, inputs: dict[str, Any], result: Any) -> None:
        self.fn(result, **{name: inputs[name] for name in self.inputs})


HOOKS: dict[str, PublishHook] = {}  # stage -> its hook, filled by @publishes as the hooks' modules load


def publishes(stage: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the decorated function as what stage `stage`'s task publishes once its entry returns. Its first
    parameter is the entry's result; its keyword-only parameters are entry inputs, by name. A stage not in the
    table, a second hook for a stage, or an input the line's entry does not take fails here, at import."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        from stages.core.isolate import resolve

        line = spec(stage)  # an unknown stage raises, naming the nearest ones
        where = f"{fn.__module__}.{fn.__qualname__}"
        params = inspect.signature(fn).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        inputs = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        if len(positional) != 1 or len(inputs) + 1 != len(params):
            raise StageTableError(f"publish hook {where}: takes the entry's result, then the entry inputs it reads "
                                  "as keyword-only parameters (def hook(result, *, name, ...))")
        entry = [n for n in inspect.signature(resolve(line.entry)).parameters if n != "force"]
        unknown = [n for n in inputs if n not in entry]
        if unknown:
            raise StageTableError(f"publish hook {where} of stage {stage!r} reads {', '.join(map(repr, unknown))}, "
                                  f"which its entry {line.entry} does not take (its parameters: {', '.join(entry)}): "
                                  "rename the hook's parameter to the entry's")
        if stage in HOOKS:
            raise StageTableError(f"stage {stage!r} has two publish hooks: {HOOKS[stage].fn.__qualname__} and "
                                  f"{where}; one stage, one hook")
        HOOKS[stage] = PublishHook(stage, fn, inputs)
        return fn

    return register


@publishes("data")
def data_files(ref: DatasetRef, *, cfg: DataSection) -> None:
    publish_table("data-files", [{"role": role, "path": path} for role, path in ref.files.items()],
                  f"Data ({cfg.source}) in {ref.path}")


@publishes("sft")
def sft_curves(ref: CheckpointRef) -> None:
    training_curves("sft", ref)


@publishes("dpo")
def dpo_curves(ref: CheckpointRef, *, checkpoint: CheckpointRef) -> None:
    if ref.path != checkpoint.path:  # DPO switched off hands the SFT checkpoint on: nothing of its own
        training_curves("dpo", ref)


def training_curves(stage: str, ref: CheckpointRef) -> None:
    """LLaMA-Factory's loss curve (`<stage>-loss`) and the training and data metrics (`<stage>-metrics`)."""
    if ref.meta.get("loss_png"):
        publish_image(f"{stage}-loss", ref.meta["loss_png"], f"{stage}: LLaMA-Factory training loss")
    metrics = ref.meta.get("metrics") or {}
    publish_table(f"{stage}-metrics", [{"metric": k, "value": v} for k, v in metrics.items()],
                  f"{stage}: training and data metrics ({ref.path})")


@publishes("merge")
def merge_parity(model: ModelRef, *, ckpt: CheckpointRef, cfg: MergeSection) -> None:
    publish_table("merge-parity", [{"source": ckpt.path, "format": ckpt.format, "merged": model.path,
                                    "dtype": cfg.dtype, "max_abs_diff": model.meta.get("max_abs_diff"),
                                    "parity_atol": model.meta.get("parity_atol")}], "merge parity probe")


@publishes("report")
def eval_report(ref: Ref, *, scores: list[ScoresRef]) -> None:
    publish_table("eval-report", ref.meta["rows"],
                  f"Evaluation over {len(scores)} benchmarks ({ref.meta['csv']})")
    if ref.meta["stage_gains"]:
        publish_table("stage-gains", ref.meta["stage_gains"], "What each stage bought: held-out accuracy per policy")
    with open(ref.meta["markdown"], encoding="utf-8") as handle:
        publish_markdown("eval-report-md", handle.read(), "Evaluation report with published numbers")


def scores_as_they_finish(benchmarks: list[str], futures: list[PrefectFuture]) -> list[ScoresRef]:
    """Wait for the score tasks, republishing the `eval-scores` table each time a benchmark is scored."""
    from stages.eval.report import progress_rows

    names = dict(zip(futures, benchmarks))
    done: dict[str, dict[str, Any]] = {}
    for future in as_completed(futures):
        done[names[future]] = future.result().meta
        publish_table("eval-scores", progress_rows(benchmarks, done),
                      f"{len(done)}/{len(benchmarks)} benchmarks scored")
    return [future.result() for future in futures]
