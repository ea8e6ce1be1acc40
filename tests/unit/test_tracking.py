"""Experiment tracking (stages/core/tracking/): a real MLflow tracking server on loopback receives the pipeline's
parent run and its stages' child runs, read back with MlflowClient; a dead tracker warns once and loses nothing;
`tracking.required` turns that into a clear error; TensorBoard's own reader reads the event files; W&B offline
writes a run folder `wandb sync` can upload.

The server (`mlflow server`, sqlite store in tmp) starts once for the module, when the module starts: the tests that
need none run first, while it boots (tens of seconds on a loaded 2-core box), and it is stopped with its process
group at the end. Nothing here trains or serves a model.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from stages.core.config.loader import load_config
from stages.core.refs import CheckpointRef, ScoresRef
from stages.core.tracking import TRACKING_ENV, TrackerUnavailable, TrackingContext, current, log_step, stage_run
from stages.core.tracking.backends import close_trackers
from stages.core.tracking.pipeline import finish_pipeline, start_pipeline
from stages.core.workspace import MARKER
from tests.unit.tracking_support import check_pipeline_run

SERVER_BOOT_S = 150


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """`mlflow server` on a free loopback port, started when the module starts; stopped with its workers."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log = open(root / "server.log", "w")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-queue workers: a faster start
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", (root / "art").as_uri(),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    yield proc, f"http://127.0.0.1:{port}", root / "server.log"
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    log.close()
    deadline = time.monotonic() + 30  # the uvicorn worker shares the group: gone with it once it has exited
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


@pytest.fixture(scope="module", autouse=True)
def _boot_early(server_process):
    """Start the server before the first test, so the tests without one run while it boots."""
    yield


@pytest.fixture
def mlflow_uri(server_process) -> str:
    proc, uri, log = server_process
    deadline = time.monotonic() + SERVER_BOOT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    return uri
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"mlflow server did not answer /health in {SERVER_BOOT_S} s: {log.read_text()[-2000:]}")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(TRACKING_ENV, raising=False)
    yield
    close_trackers()


def _config(tmp_path: Path, *overrides: str):
    return load_config("tiny-cpu", [f"run.output_root={tmp_path / 'outputs'}",
                                    f"tracking.experiment=test-{uuid.uuid4().hex[:8]}", *overrides])


def _run_dir(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / "outputs" / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("profile: tiny-cpu\n")
    return run_dir


def _stage_folder(tmp_path: Path, stage: str, key: str) -> Path:
    folder = tmp_path / "outputs" / stage / key
    folder.mkdir(parents=True)
    return folder


def _train(folder: Path, steps: int) -> list[dict]:
    """A stage's loop as the RL trainer writes it: each step's row to metrics.jsonl, then to the tracker."""
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "pid": os.getpid(), "reward/mean": 0.1 * step, "entropy/mean": 1.0 / step,
               "tools/calls_per_traj": float(step), "finish/stop": 1.0}
        with open(folder / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        log_step(row)
        rows.append(row)
    return rows


# ---- without a server: dead tracker, required, TensorBoard, W&B ---------------------------------------------------
def test_a_dead_tracker_warns_once_and_loses_nothing(tmp_path, caplog) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    cfg = _config(tmp_path, f"tracking.tracking_uri={dead}")
    with caplog.at_level(logging.WARNING):
        ctx = start_pipeline(cfg, _run_dir(tmp_path, "tiny-dead"))
        for stage in ("sft", "rl"):
            folder = _stage_folder(tmp_path, stage, f"{stage}key0000000")
            with stage_run(stage, folder) as run:
                assert not run.active
                rows = _train(folder, 3)
                assert run.handoff().report_to == "none"  # LLaMA-Factory / verl are told to report nowhere
            # nothing lost: every row is in metrics.jsonl, and no record of a run that does not exist
            assert [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()] == rows
            assert not (folder / "tracking.json").exists()
        finish_pipeline({}, ctx)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "tracking" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert dead in json.loads(os.environ[TRACKING_ENV])["uri"] and ctx.disabled and not ctx.active


def test_a_required_dead_tracker_fails_with_the_fix(tmp_path) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    cfg = _config(tmp_path, f"tracking.tracking_uri={dead}", "tracking.required=true")
    with pytest.raises(TrackerUnavailable) as err:
        start_pipeline(cfg, _run_dir(tmp_path, "tiny-required"))
    text = str(err.value)
    assert "tracking.required is true" in text and dead in text and "tracking.required=false" in text
    # a stage handed a live-looking context fails the same way when its tracker is gone
    ctx = TrackingContext(backend="mlflow", uri=dead, experiment="x", parent_id="p", required=True)
    with pytest.raises(TrackerUnavailable, match="mlflow server"):
        with stage_run("rl", _stage_folder(tmp_path, "rl", "k"), ctx=ctx):
            pass


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path) -> None:
    from tensorboard.backend.event_processing import event_accumulator
    cfg = _config(tmp_path, "tracking.backend=tensorboard")
    ctx = start_pipeline(cfg, _run_dir(tmp_path, "tiny-tb"), card="# card\n")
    folder = _stage_folder(tmp_path, "rl", "rlkey123456789")
    with stage_run("rl", folder) as run:
        _train(folder, 3)
        env = run.handoff(nested="verl").env
    finish_pipeline({}, ctx)
    logdir = tmp_path / "outputs" / "tensorboard" / cfg.tracking.experiment / "tiny-tb" / "rl-rlkey12345"
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert "pid" not in acc.Tags()["scalars"]  # counters are no curves
    assert env["TENSORBOARD_DIR"] == str(logdir / "rl-rlkey12345-verl")  # verl's own logger: a folder inside
    assert (logdir.parent / "algorithm_card.md").is_file() and (logdir.parent / "params.json").is_file()


def _wandb_records(path: Path):
    """The records of an offline run file (wandb's LevelDB-style log: 7-byte header, 32 KiB blocks, records of
    crc32 / length / type + a wandb_internal Record)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_writes_a_run_folder_wandb_sync_can_upload(tmp_path, monkeypatch) -> None:
    import wandb  # noqa: F401 - installed with the project
    monkeypatch.setenv("WANDB_MODE", "disabled")  # what stages.core.env sets: offline mode must still write
    cfg = _config(tmp_path, "tracking.backend=wandb")
    ctx = start_pipeline(cfg, _run_dir(tmp_path, "tiny-wandb"))
    folder = _stage_folder(tmp_path, "rl", "rlkeywandb0000")
    with stage_run("rl", folder):
        _train(folder, 2)
        run_id = json.loads((folder / "tracking.json").read_text())["run_id"]
    finish_pipeline({}, ctx)
    [run_file] = (tmp_path / "outputs" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    steps = []
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            steps.append((items["_step"], items["reward/mean"]))
    assert steps == [(1, 0.1), (2, 0.2)]
    runs = list((tmp_path / "outputs" / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # the pipeline's run (config) and the stage's, one group


# ---- a real MLflow tracking server ---------------------------------------------------------------------------------
def test_parent_and_stage_runs_reach_a_real_mlflow_server(tmp_path, mlflow_uri, monkeypatch) -> None:
    from mlflow import MlflowClient

    cfg = _config(tmp_path, f"tracking.tracking_uri={mlflow_uri}")
    ctx = start_pipeline(cfg, _run_dir(tmp_path, "tiny-20260101"), card="# ARPO card\n")
    sft, rl = _stage_folder(tmp_path, "sft", "sftkey0123456789"), _stage_folder(tmp_path, "rl", "rlkey0123456789")
    with stage_run("sft", sft) as run:
        # LLaMA-Factory's report_to: mlflow resumes the stage's run from the environment, as HF's MLflowCallback does
        handoff = run.handoff()
        assert handoff.report_to == "mlflow" and handoff.env["MLFLOW_RUN_ID"] == run.run_id
        _log_like_hf_callback(handoff.env, monkeypatch, handoff.name, losses=[2.0, 1.5, 1.2])
    with stage_run("rl", rl) as run:
        _train(rl, 2)
        verl = run.handoff(nested="verl")
        assert verl.verl_logger == "mlflow" and verl.env["MLFLOW_RUN_ID"] != run.run_id
    score = ScoresRef(path=str(tmp_path), fingerprint="f", benchmark="synthetic",
                      meta={"metrics": {"accuracy": {"value": 0.5}, "pass@2": {"value": 0.75}}, "tool_calls": 1.5})
    finish_pipeline({"score": [score]}, ctx)

    client = MlflowClient(mlflow_uri)
    parent = client.get_run(ctx.parent_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "tiny-20260101"
    assert parent.data.params["rl.algorithm"] == "arpo" and parent.data.params["tracking.backend"] == "mlflow"
    assert parent.data.tags["arpo.profile"] == "tiny-cpu" and parent.data.tags["arpo.engine"] == "local"
    assert {a.path for a in client.list_artifacts(ctx.parent_id)} == {"config.yaml", "algorithm_card.md"}
    assert parent.data.metrics == {"eval/synthetic/accuracy": 0.5, "eval/synthetic/pass_at_2": 0.75,
                                   "eval/synthetic/tool_calls": 1.5}
    children = _children(client, ctx, ctx.parent_id)
    assert sorted(children) == ["rl-rlkey01234", "sft-sftkey0123"]
    sft_run, rl_run = children["sft-sftkey0123"], children["rl-rlkey01234"]
    assert [m.step for m in client.get_metric_history(sft_run.info.run_id, "loss")] == [1, 2, 3]
    assert set(rl_run.data.metrics) == {"reward/mean", "entropy/mean", "tools/calls_per_traj", "finish/stop"}
    assert [(m.step, m.value) for m in client.get_metric_history(rl_run.info.run_id, "reward/mean")] == \
        [(1, 0.1), (2, 0.2)]
    assert rl_run.data.tags["arpo.stage_key"] == "rlkey0123456789" and rl_run.info.status == "FINISHED"
    assert list(_children(client, ctx, rl_run.info.run_id)) == ["rl-rlkey01234-verl"]  # verl's own logger's run
    record = json.loads((rl / "tracking.json").read_text())
    assert record["run_id"] == rl_run.info.run_id and record["parent_id"] == ctx.parent_id
    # the check the end-to-end runs make (tests/unit/tracking_support.py)
    assert check_pipeline_run(mlflow_uri, ctx.experiment, rl_steps=2, benchmarks=["synthetic"]).info.run_id == \
        ctx.parent_id


def test_a_cached_stage_logs_nothing_and_links_the_run_that_produced_it(tmp_path, mlflow_uri) -> None:
    """The tiny chain's case: the stage was computed by a run with its own local store (sqlite under its outputs),
    the rerun reports to the server and links the producing run there."""
    from mlflow import MlflowClient

    first = start_pipeline(_config(tmp_path), _run_dir(tmp_path, "tiny-first"))  # the default local store
    assert first.uri == f"sqlite:///{(tmp_path / 'outputs').resolve()}/mlflow/mlflow.db"
    folder = _stage_folder(tmp_path, "rl", "rlcachedkey00001")
    with stage_run("rl", folder) as run:
        _train(folder, 2)
        produced_by = run.run_id
    (folder / MARKER).write_text(json.dumps({"key": folder.name}))  # the folder is complete
    ref = CheckpointRef(path=str(folder / "checkpoints" / "step_2"), fingerprint="f", format="trainer")
    finish_pipeline({"rl": ref}, first)
    assert list(_children(MlflowClient(first.uri), first, first.parent_id)) == ["rl-rlcachedke"]  # not linked

    cfg = _config(tmp_path, f"tracking.tracking_uri={mlflow_uri}")
    second = start_pipeline(cfg, _run_dir(tmp_path, "tiny-second"))  # the rerun: RL comes from the cache
    assert current().run_id is None  # no stage ran: nothing is open
    finish_pipeline({"rl": ref}, second)

    client = MlflowClient(mlflow_uri)
    [linked] = _children(client, second, second.parent_id).values()
    source = f"mlflow:{first.uri}#{produced_by}"  # in another store: where, and which run
    assert linked.info.run_name == "rl-rlcachedke (cached)" and linked.data.metrics == {}
    assert linked.data.tags["arpo.source_run_id"] == source
    assert linked.data.tags["arpo.source_pipeline_run"] == "tiny-first"
    assert client.get_run(second.parent_id).data.tags["arpo.stage.rl"] == source
    # the curves of a cached stage are found through its link (tracking_support.py)
    check_pipeline_run(mlflow_uri, second.experiment, rl_steps=2, sft_loss=False, cached=["rl"])


def _children(client, ctx: TrackingContext, parent_id: str) -> dict:
    experiment = client.get_experiment_by_name(ctx.experiment)
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    return {run.info.run_name: run for run in runs}


def _log_like_hf_callback(env: dict[str, str], monkeypatch, run_name: str, losses: list[float]) -> None:
    """What transformers' MLflowCallback does with report_to: mlflow (integration_utils.py setup / on_log /
    on_train_end): set_experiment(MLFLOW_EXPERIMENT_NAME), start_run(run_name=args.run_name) resuming MLFLOW_RUN_ID
    (and renaming it: LLaMA-Factory's train.yaml gets run_name = the stage run's name), log_metrics per logging step,
    end_run()."""
    import mlflow

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    mlflow.set_experiment(env["MLFLOW_EXPERIMENT_NAME"])
    mlflow.start_run(run_name=run_name)
    assert mlflow.active_run().info.run_id == env["MLFLOW_RUN_ID"]
    mlflow.log_params({"learning_rate": "0.0002"})
    for step, loss in enumerate(losses, start=1):
        mlflow.log_metrics({"loss": loss}, step=step)
    mlflow.end_run()
