"""MLflow: the pipeline's run is a parent run, each stage a child (tag `mlflow.parentRunId`), in one experiment.

Talks to MLflow through `MlflowClient` only (no fluent API, so no process-wide active run): a tracking server
(http://...) is checked first with its /health endpoint, a local store (sqlite:///.../mlflow.db, the default under
run.output_root) needs no server, and its artifacts go beside it (<store folder>/artifacts). Another process logs
into a run through MLflow's own variables: MLFLOW_TRACKING_URI and MLFLOW_RUN_ID, which Hugging Face's MLflowCallback
(LLaMA-Factory's report_to: mlflow) and verl's MLflow logger (verl/utils/tracking.py Tracking.__init__) both resume.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from stages.core.tracking.backends import Backend
from stages.core.tracking.context import TrackingContext, safe_key

HEALTH_TIMEOUT_S = 5
# MLflow's HTTP client retries 7 times with backoff (minutes against a dead server); ours gives up sooner, and so
# do the loggers the environment reaches (a user's own values win)
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
BATCH_METRICS, BATCH_PARAMS, PARAM_CHARS = 1000, 100, 6000   # MLflow's log_batch and param-value limits


def local_store(uri: str) -> Path | None:
    """The database file of a sqlite:/// store, else None."""
    return Path(uri.removeprefix("sqlite:///")).resolve() if uri.startswith("sqlite:///") else None


def check_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Raise unless the tracking server at `uri` answers /health (fails in seconds, not after MLflow's retries)."""
    with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
        if response.status != 200:
            raise ConnectionError(f"{uri}/health answered {response.status}")


class MlflowBackend(Backend):
    def __init__(self, ctx: TrackingContext) -> None:
        super().__init__(ctx)
        for key, value in HTTP_ENV.items():
            os.environ.setdefault(key, value)
        if urlparse(ctx.uri).scheme in ("http", "https"):
            check_server(ctx.uri)
        store = local_store(ctx.uri)
        if store is not None:
            store.parent.mkdir(parents=True, exist_ok=True)
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=ctx.uri)
        self.artifacts = (store.parent / "artifacts").as_uri() if store is not None else None
        self.experiment_id = self._experiment(ctx.experiment)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            location = f"{self.artifacts}/{name}" if self.artifacts else None
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # another process created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def start_run(self, name: str, tags: Mapping[str, str], parent_id: str | None) -> str:
        tags = {safe_key(k): str(v)[:5000] for k, v in tags.items()}
        if parent_id:
            tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(safe_key(k), float(v), now, int(step or 0)) for k, v in metrics.items()]
        for i in range(0, len(rows), BATCH_METRICS):
            self.client.log_batch(run_id, metrics=rows[i:i + BATCH_METRICS])

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        rows = [Param(safe_key(k)[:250], str(v)[:PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(rows), BATCH_PARAMS):
            self.client.log_batch(run_id, params=rows[i:i + BATCH_PARAMS])

    def log_artifact(self, run_id: str, path: Path) -> None:
        self.client.log_artifact(run_id, str(path))

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(run_id, safe_key(key), str(value)[:5000])

    def end_run(self, run_id: str, failed: bool = False) -> None:
        self.client.set_terminated(run_id, "FAILED" if failed else "FINISHED")

    def handoff_env(self, run_id: str, name: str) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.ctx.uri, "MLFLOW_RUN_ID": run_id,
                "MLFLOW_EXPERIMENT_NAME": self.ctx.experiment,
                **{key: os.environ.get(key, value) for key, value in HTTP_ENV.items()}}


BACKEND = MlflowBackend
