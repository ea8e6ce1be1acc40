"""What the stage tasks publish to the Prefect UI once their entry point returns: the hooks the stage table names
(`publish` in stages/core/stage_spec.py; tasks.common.entry_task calls one with the task's inputs and the stage's
result), and the `eval-scores` table the flow republishes while the benchmarks are scored.

A hook only reads what the stage returned and its inputs: the stage's folder is finished before the hook runs, so a
hook that fails fails the task, and its retry or rerun finds the folder complete and publishes without redoing work."""

from __future__ import annotations

from typing import Any

from prefect.futures import PrefectFuture, as_completed

from stages.core.refs import CheckpointRef, DatasetRef, ModelRef, Ref, ScoresRef
from tasks.artifacts import publish_image, publish_markdown, publish_table


def data_files(inputs: dict[str, Any], ref: DatasetRef) -> None:
    publish_table("data-files", [{"role": role, "path": path} for role, path in ref.files.items()],
                  f"Data ({inputs['cfg'].source}) in {ref.path}")


def sft_curves(inputs: dict[str, Any], ref: CheckpointRef) -> None:
    training_curves("sft", ref)


def dpo_curves(inputs: dict[str, Any], ref: CheckpointRef) -> None:
    if ref.path != inputs["checkpoint"].path:  # DPO switched off hands the SFT checkpoint on: nothing of its own
        training_curves("dpo", ref)


def training_curves(stage: str, ref: CheckpointRef) -> None:
    """LLaMA-Factory's loss curve (`<stage>-loss`) and the training and data metrics (`<stage>-metrics`)."""
    if ref.meta.get("loss_png"):
        publish_image(f"{stage}-loss", ref.meta["loss_png"], f"{stage}: LLaMA-Factory training loss")
    metrics = ref.meta.get("metrics") or {}
    publish_table(f"{stage}-metrics", [{"metric": k, "value": v} for k, v in metrics.items()],
                  f"{stage}: training and data metrics ({ref.path})")


def merge_parity(inputs: dict[str, Any], model: ModelRef) -> None:
    ckpt, cfg = inputs["ckpt"], inputs["cfg"]
    publish_table("merge-parity", [{"source": ckpt.path, "format": ckpt.format, "merged": model.path,
                                    "dtype": cfg.dtype, "max_abs_diff": model.meta.get("max_abs_diff"),
                                    "parity_atol": model.meta.get("parity_atol")}], "merge parity probe")


def eval_report(inputs: dict[str, Any], ref: Ref) -> None:
    publish_table("eval-report", ref.meta["rows"],
                  f"Evaluation over {len(inputs['scores'])} benchmarks ({ref.meta['csv']})")
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
