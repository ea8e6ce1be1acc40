"""The pipeline's run on the tracker: opened when a run starts, closed with its summary (tasks/run_record.py).

    ctx = start_pipeline(cfg, run_dir, card_markdown)   # the parent run: params = the resolved config, artifacts =
                                                        # config.yaml and the algorithm card; ARPO_TRACKING set
    finish_pipeline(refs)                               # cached stages linked, eval scores as summary, run ended

Only the flow's side imports this module (it reads the config's tracking section); stages see the run through the
environment (stages.core.tracking.stage). A stage that computed recorded its child run in its folder
(`tracking.json`); one whose output came from an earlier run (the Prefect cache, a complete folder) logged nothing:
`finish_pipeline` adds a child `<stage>-<key> (cached)` tagged with the run that produced it (`arpo.source_run_id`)
and, on the parent, `arpo.stage.<stage>` = that run.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stages.core.atomic import write_text
from stages.core.config.root import RunConfig
from stages.core.log import get_logger
from stages.core.provenance import git_state
from stages.core.tracking.backends import TRACKING_BACKENDS, tracker_for
from stages.core.tracking.context import CARD_FILE, TRACKING_ENV, TrackingContext, flatten, safe_key, stage_run_name
from stages.core.tracking.stage import read_record

log = get_logger(__name__)
_open_parents: dict[str, TrackingContext] = {}


def context_of(cfg: RunConfig, run_name: str) -> TrackingContext:
    """The run's tracking context before its parent run exists: backend, resolved URI, experiment, tags."""
    section = cfg.tracking
    line = TRACKING_BACKENDS.get(section.backend)
    uri = section.tracking_uri or default_uri(line.name, line.local_folder, cfg.run.output_root)
    commit = git_state()
    tags = {"arpo.profile": cfg.profile, "arpo.algorithm": cfg.rl.algorithm, "arpo.engine": cfg.rl.engine,
            "arpo.commit": str(commit.get("commit") or "unknown") + ("-dirty" if commit.get("dirty") else ""),
            "arpo.pipeline_run": run_name, **section.tags}
    return TrackingContext(backend=line.name, uri=uri, experiment=section.experiment or f"arpo-{cfg.profile}",
                           parent_name=run_name, tags=tags, required=section.required,
                           wandb_mode=section.wandb_mode)


def preload(section: Any) -> None:
    """Import the tracker library the config's `tracking` section names, for a caller with time to spare before
    the flow's first task opens it: `arpo run` while a temporary Prefect server boots on the other core
    (flows/launch.py). mlflow's import is the one that costs (1.5 s of CPU on the 2-core box, its SQL store's
    included); nothing is opened, and a failure is left for the tracker's open to report."""
    if section.backend != "mlflow":
        return
    try:
        import mlflow  # noqa: F401

        if not section.tracking_uri or section.tracking_uri.startswith("sqlite"):  # the local store (the default)
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the tracker's open reports it (one warning, or TrackerUnavailable)
        log.debug("tracking: preloading mlflow: %s", err)


def default_uri(backend: str, folder: str, output_root: str) -> str:
    """The local store under run.output_root: sqlite:///<abs>/mlflow/mlflow.db for MLflow, else a folder."""
    if not folder:
        return ""
    where = Path(output_root).resolve() / folder
    return f"sqlite:///{where / 'mlflow.db'}" if backend == "mlflow" else str(where)


def start_pipeline(cfg: RunConfig, run_dir: str | Path, card: str | None = None) -> TrackingContext:
    """Open the pipeline's run and put its context into the environment for the stages; returns the context
    (`disabled` says why nothing is tracked when the tracker failed and tracking.required is false)."""
    run_dir = Path(run_dir)
    ctx = context_of(cfg, run_dir.name)
    if not ctx.active:
        ctx.to_env()
        return ctx
    tracker = tracker_for(ctx, fresh=True)
    parent = tracker.start_run(run_dir.name, {**ctx.tags, "arpo.stage": "pipeline"}, None)
    if parent is not None:
        tracker.log_params(parent, flatten(cfg.model_dump(mode="json")))
        tracker.log_artifact(parent, run_dir / "config.yaml")
        if card:
            tracker.log_artifact(parent, write_text(run_dir / CARD_FILE, card))
    ctx = TrackingContext(**{**ctx.__dict__, "parent_id": parent, "disabled": tracker.dead})
    ctx.to_env()
    if parent is not None:
        _open_parents[parent] = ctx
        log.info("tracking: %s run %s (%s, experiment %s)", ctx.backend, run_dir.name, ctx.uri, ctx.experiment)
    return ctx


def finish_pipeline(refs: dict[str, Any], ctx: TrackingContext | None = None, failed: bool = False) -> None:
    """Link the stages whose output an earlier run produced, log the eval scores as the run's summary, end it."""
    ctx = ctx if ctx is not None else TrackingContext.from_env()
    if ctx is None or not ctx.active or not ctx.parent_id:
        return
    tracker = tracker_for(ctx)
    for stage, ref in _stage_refs(refs):
        folder = _stage_folder(ref)
        record = read_record(folder) if folder else None
        if record and record.get("parent_id") != ctx.parent_id:
            link_cached(ctx, stage, record)
    tracker.log_summary(ctx.parent_id, eval_summary(refs))
    tracker.end_run(ctx.parent_id, failed)
    _open_parents.pop(ctx.parent_id, None)
    if TrackingContext.from_env() == ctx:  # a stage run later in this process is no child of an ended run
        os.environ.pop(TRACKING_ENV, None)


def link_cached(ctx: TrackingContext, stage: str, record: dict[str, Any]) -> None:
    """A child run that logs nothing and names the run that produced the cached output."""
    tracker = tracker_for(ctx)
    same_store = record.get("uri") == ctx.uri and record.get("backend") == ctx.backend
    source = record.get("run_id", "") if same_store else f"{record.get('backend')}:{record.get('uri')}#" \
                                                            f"{record.get('run_id')}"
    name = record.get("name") or stage_run_name(stage, record.get("key", ""))
    tags = {**ctx.tags, "arpo.stage": stage, "arpo.stage_key": str(record.get("key", "")), "arpo.cached": "true",
            "arpo.source_run_id": str(source), "arpo.source_pipeline_run": str(record.get("parent_name", "")),
            "mlflow.note.content": f"Cached: this output was produced by run {source} "
                                   f"(pipeline run {record.get('parent_name')}); its curves are there."}
    child = tracker.start_run(f"{name} (cached)", tags, ctx.parent_id)
    tracker.end_run(child)
    tracker.set_tags(ctx.parent_id, {f"arpo.stage.{stage}": str(source)})


def eval_summary(refs: dict[str, Any]) -> dict[str, float]:
    """The run's summary metrics: each scored benchmark's accuracy and pass@k and its tool use
    (`eval/<benchmark>/<metric>`), and the held-out scores of each policy (`heldout/<policy>/<split>/<metric>`),
    from the score refs' summaries (cached or not)."""
    out: dict[str, float] = {}
    for key, value in refs.items():
        if key != "score" and not key.startswith("heldout-"):
            continue
        prefix = "eval" if key == "score" else key.replace("-", "/", 1)
        for ref in value if isinstance(value, list | tuple) else [value]:
            bench, meta = getattr(ref, "benchmark", None), getattr(ref, "meta", None) or {}
            if not bench or not isinstance(meta.get("metrics"), dict):
                continue
            for name, stats in meta["metrics"].items():
                if isinstance(stats, dict) and isinstance(stats.get("value"), int | float):
                    out[safe_key(f"{prefix}/{bench}/{name}")] = float(stats["value"])
            for name in ("tool_calls", "tool_use_rate", "em", "f1"):
                if isinstance(meta.get(name), int | float) and not isinstance(meta.get(name), bool):
                    out[f"{prefix}/{bench}/{name}"] = float(meta[name])
    return out


def _stage_refs(refs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, value in refs.items():
        for ref in value if isinstance(value, list | tuple) else [value]:
            if ref is not None and getattr(ref, "path", None):
                yield name.split("-")[0], ref


def _stage_folder(ref: Any, levels: int = 4) -> Path | None:
    """The stage folder holding a ref's path (the one with a completion marker), up to `levels` above it."""
    from stages.core.workspace import MARKER

    here = Path(ref.path)
    for folder in [f for f in (here, *here.parents) if f.name][: levels + 1]:
        if (folder / MARKER).is_file():
            return folder
    return None


@atexit.register
def _end_abandoned() -> None:
    """A pipeline run whose flow died before its summary: its run is ended as failed, not left running."""
    for parent, ctx in list(_open_parents.items()):
        try:
            tracker_for(ctx).end_run(parent, failed=True)
        except Exception:  # noqa: BLE001 - nothing may fail at exit
            pass
    _open_parents.clear()
