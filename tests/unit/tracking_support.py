"""What a pipeline run must leave in its MLflow tracker (docs/ui.md "Where the curves go"), read back with
MlflowClient: for the tracker tests here and for the end-to-end runs (tests/integration), e.g. after the tiny
chain's first run

    check_pipeline_run(f"sqlite:///{outputs.resolve()}/mlflow/mlflow.db", "arpo-tiny-cpu", rl_steps=1,
                       cached=["sft"], benchmarks=["synthetic"])

A cached stage's child names the run that produced it (`arpo.source_run_id`: a run id in the same store, or
`<backend>:<uri>#<run id>` in another, such as the tiny chain's own store); its curves are read there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

RL_CURVES = {"reward/mean", "entropy/mean", "tools/calls_per_traj"}


def pipeline_run(client: Any, experiment: str) -> Any:
    """The newest pipeline (parent) run of `experiment`."""
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {client.tracking_uri}"
    runs = client.search_runs([found.experiment_id], filter_string="tags.`arpo.stage` = 'pipeline'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    assert runs, f"no pipeline run in experiment {experiment!r} of {client.tracking_uri}"
    return runs[0]


def stage_runs(client: Any, parent: Any) -> dict[str, list[Any]]:
    """The parent's child runs by stage (`arpo.stage`), in start order."""
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                              order_by=["attributes.start_time ASC"])
    out: dict[str, list[Any]] = {}
    for run in runs:
        out.setdefault(run.data.tags.get("arpo.stage", "?"), []).append(run)
    return out


def source_of(client: Any, run: Any) -> tuple[Any, Any]:
    """(client, run) holding a stage's curves: the run itself, or for a cached stage the run that produced it."""
    from mlflow import MlflowClient

    source = run.data.tags.get("arpo.source_run_id")
    if run.data.tags.get("arpo.cached") != "true" or not source:
        return client, run
    if "#" in source:  # <backend>:<uri>#<run id>: another store
        where, run_id = source.split(":", 1)[1].rsplit("#", 1)
        other = MlflowClient(where)
        return other, other.get_run(run_id)
    return client, client.get_run(source)


def steps(client: Any, run: Any, metric: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run.info.run_id, metric)]


def check_pipeline_run(uri: str, experiment: str, rl_steps: int | None = None, sft_loss: bool = True,
                       cached: Sequence[str] = (), benchmarks: Sequence[str] = ()) -> Any:
    """Assert the newest pipeline run of `experiment` at `uri`: finished, with the resolved config and its artifact;
    the stages in `cached` linked (no metrics of their own); the SFT loss per logging step (`sft_loss`); `rl_steps`
    steps of the RL curves under the local engine's names (either engine); each of `benchmarks`' accuracy as a
    summary metric. Returns the parent run."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parent = pipeline_run(client, experiment)
    assert parent.info.status == "FINISHED", parent.info
    assert parent.data.params.get("tracking.backend") == "mlflow" and "rl.algorithm" in parent.data.params
    assert "config.yaml" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    children = stage_runs(client, parent)
    for stage in cached:
        assert stage in children, f"no run of the cached stage {stage}: {sorted(children)}"
        run = children[stage][-1]
        assert run.data.tags.get("arpo.cached") == "true" and not run.data.metrics, run.data
    if sft_loss:
        assert "sft" in children, f"no SFT run under the pipeline run: {sorted(children)}"
        sft_client, sft = source_of(client, children["sft"][-1])
        logged = steps(sft_client, sft, "loss")
        assert logged and logged == sorted(logged), f"SFT loss steps {logged}"
    if rl_steps is not None:
        assert "rl" in children, f"no RL run under the pipeline run: {sorted(children)}"
        rl_client, rl = source_of(client, children["rl"][-1])
        assert RL_CURVES <= set(rl.data.metrics), sorted(rl.data.metrics)
        assert steps(rl_client, rl, "reward/mean") == list(range(1, rl_steps + 1))
    for bench in benchmarks:
        assert f"eval/{bench}/accuracy" in parent.data.metrics, sorted(parent.data.metrics)
    return parent
