"""Where the stages hand their curves to the tracker (stages/core/tracking/): the config section, LLaMA-Factory's
report_to, verl's trainer.logger and its environment, the verl launcher's per-step rows, eval's summary metrics.
Pure or on TensorBoard files in tmp: no server, no model (the MLflow server tests are test_tracking.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core.config.loader import ConfigError, load_config
from stages.core.refs import ScoresRef
from stages.core.tracking import TRACKING_ENV, Handoff, TrackingContext, numeric, stage_run
from stages.core.tracking.backends import TRACKING_BACKENDS, close_trackers
from stages.core.tracking.context import flatten, safe_key
from stages.core.tracking.pipeline import context_of, eval_summary
from stages.eval.scoring import score_metrics
from stages.rl.verl.mapping import VerlPaths, verl_overrides
from stages.sft import lf_config

PATHS = VerlPaths(model="/m", train_file="/d/t.parquet", val_file="/d/v.parquet", checkpoints="/o/ck",
                  settings="/o/s.json", agent_loops="/o/a.yaml", rollout_dump="/o/r", experiment="rlkey")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(TRACKING_ENV, raising=False)
    yield
    close_trackers()


def test_the_default_is_a_local_mlflow_store_under_the_outputs(tmp_path) -> None:
    cfg = load_config("tiny-cpu", [f"run.output_root={tmp_path}"])
    ctx = context_of(cfg, "tiny-20260101-1200")
    # no server: `mlflow ui --backend-store-uri sqlite:///<output_root>/mlflow/mlflow.db` reads it
    assert ctx.backend == "mlflow" and ctx.uri == f"sqlite:///{tmp_path.resolve()}/mlflow/mlflow.db"
    assert ctx.experiment == "arpo-tiny-cpu" and ctx.parent_name == "tiny-20260101-1200"
    assert {k: ctx.tags[k] for k in ("arpo.profile", "arpo.algorithm", "arpo.engine")} == \
        {"arpo.profile": "tiny-cpu", "arpo.algorithm": "arpo", "arpo.engine": "local"}
    assert ctx.tags["arpo.commit"]
    other = context_of(load_config("tiny-cpu", ["tracking.backend=tensorboard", "tracking.experiment=ab"]), "r")
    assert other.uri.endswith("outputs/tensorboard") and other.experiment == "ab"


def test_the_backend_is_a_registry_name_and_wandb_settings_need_wandb() -> None:
    assert TRACKING_BACKENDS.names() == ["mlflow", "none", "tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="unknown tracking backend 'mlfow'.*Did you mean 'mlflow'"):
        load_config("tiny-cpu", ["tracking.backend=mlfow"])
    with pytest.raises(ConfigError, match="tracking.wandb_mode=online is ignored under tracking.backend=mlflow"):
        load_config("tiny-cpu", ["tracking.wandb_mode=online"])
    assert load_config("tiny-cpu", ["tracking.backend=wandb", "tracking.wandb_mode=online"]).tracking.wandb_mode == \
        "online"


def test_context_crosses_the_environment_and_none_tracks_nothing(tmp_path) -> None:
    ctx = TrackingContext(backend="mlflow", uri="sqlite:///x.db", experiment="e", parent_id="p", tags={"a": "b"})
    environ: dict[str, str] = {}
    ctx.to_env(environ)
    assert TrackingContext.from_env(environ) == ctx
    assert TrackingContext.from_env({TRACKING_ENV: "{not json"}) is None
    with stage_run("rl", tmp_path, ctx=TrackingContext(backend="none")) as run:
        assert not run.active and run.handoff() == Handoff()
    assert not (tmp_path / "tracking.json").exists()


def test_names_and_values_the_trackers_get() -> None:
    assert numeric({"step": 3, "pid": 12, "resumed_from": None, "reward/mean": 0.5, "ok": True, "n": 2,
                    "note": "x"}) == {"reward/mean": 0.5, "n": 2.0}
    assert safe_key("eval/gsm8k/pass@4") == "eval/gsm8k/pass_at_4" and safe_key("a//b(c)") == "a/b_c_"
    assert flatten({"rl": {"n": 4, "betas": [0.9, 0.99], "extra": {}}, "profile": "tiny"}) == \
        {"rl.n": "4", "rl.betas": "[0.9, 0.99]", "rl.extra": "{}", "profile": "tiny"}


def test_llamafactory_reports_to_the_stages_run() -> None:
    cfg = load_config("tiny-cpu").sft
    common = {"model_path": "/m", "template": "qwen", "dataset_dir": "/d", "dataset": "x", "output_dir": "/o"}
    assert lf_config.sft_train_args(cfg, **common)["report_to"] == "none"
    args = lf_config.sft_train_args(cfg, **common, report_to="mlflow", run_name="sft-0123456789")
    # run_name: Hugging Face's MLflowCallback would rename the resumed run to the output folder otherwise
    assert args["report_to"] == "mlflow" and args["run_name"] == "sft-0123456789"
    dpo = lf_config.dpo_train_args(cfg.dpo, cfg, **common, report_to="tensorboard", run_name="dpo-1")
    assert dpo["report_to"] == "tensorboard" and dpo["run_name"] == "dpo-1"


def _overrides(handoff: Handoff | None) -> dict[str, str]:
    rl = load_config("tiny-cpu", ["rl.engine=verl"]).rl
    return dict(o.split("=", 1) for o in verl_overrides(rl, "float32", 0, PATHS, handoff=handoff))


def test_verl_logs_to_the_tracker_through_its_own_logger() -> None:
    plain = _overrides(None)
    assert plain["trainer.logger"] == "[console,file]" and plain["trainer.project_name"] == "arpo-pipeline"
    assert plain["trainer.experiment_name"] == "rlkey"
    handoff = Handoff(env={"MLFLOW_TRACKING_URI": "sqlite:////o/mlflow/mlflow.db", "MLFLOW_RUN_ID": "abc123",
                           "MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "WANDB_DISABLED": "false"},
                      report_to="mlflow", verl_logger="mlflow", project="arpo-tiny-cpu", name="rl-0123456789-verl")
    o = _overrides(handoff)
    # verl/utils/tracking.py (the pinned verl): "mlflow" in trainer.logger reads MLFLOW_TRACKING_URI and resumes
    # MLFLOW_RUN_ID in the trainer's process (Ray's runtime env reaches it); the file logger stays (metrics.jsonl)
    assert o["trainer.logger"] == "[console,file,mlflow]"
    assert o["trainer.project_name"] == "arpo-tiny-cpu" and o["trainer.experiment_name"] == "rl-0123456789-verl"
    env = "+ray_kwargs.ray_init.runtime_env.env_vars."
    assert o[f"{env}MLFLOW_RUN_ID"] == "'abc123'" and o[f"{env}MLFLOW_TRACKING_URI"] == "'sqlite:////o/mlflow/mlflow.db'"
    assert o[f"{env}MLFLOW_HTTP_REQUEST_TIMEOUT"] == "'20'" and o[f"{env}WANDB_DISABLED"] == "'false'"  # strings
    assert _overrides(Handoff(verl_logger=None, env={"X": "1"}))["trainer.logger"] == "[console,file]"


def test_verl_steps_reach_the_stage_run_under_the_local_engines_names(tmp_path) -> None:
    from tensorboard.backend.event_processing import event_accumulator as accumulator

    from stages.rl.verl.monitor import LiveReport, our_row

    class Bar:
        def update(self, step, note=""):
            pass

    cfg = load_config("tiny-cpu", ["rl.engine=verl", "rl.trainer.report_every=100"]).rl
    ctx = TrackingContext(backend="tensorboard", uri=str(tmp_path / "tb"), experiment="e", parent_id="p")
    (tmp_path / "stage").mkdir()
    with stage_run("rl", tmp_path / "stage", key="verlkey12345", ctx=ctx):
        live = LiveReport(cfg, tmp_path / "stage", Bar(), resumed_step=0)
        for step in (1, 2):  # what verl logged, renamed as for metrics.jsonl
            live.on_step(our_row(step, {"arpo/reward/mean": 0.25 * step, "actor/pg_loss": 1.0 / step,
                                        "timing_s/gen": 3.0}))
    acc = accumulator.EventAccumulator(str(tmp_path / "tb" / "e" / "p" / "rl-verlkey123"))
    acc.Reload()
    assert {"reward/mean", "loss", "timing/rollout_s"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert json.loads((tmp_path / "stage" / "tracking.json").read_text())["run_id"] == "p/rl-verlkey123"


def test_eval_scores_are_summary_metrics() -> None:
    summary = {"benchmark": "gsm8k", "metrics": {"accuracy": {"value": 0.5, "ci_low": 0.4},
                                                 "pass@4": {"value": 0.8}}, "tool_calls": 1.25, "em": 0.5}
    assert score_metrics(summary) == {"accuracy": 0.5, "pass@4": 0.8, "tool_calls": 1.25, "em": 0.5}
    refs = {"score": [ScoresRef(path="/s", fingerprint="f", benchmark="gsm8k", meta=summary)],
            "heldout-rl": ScoresRef(path="/h", fingerprint="f", benchmark="math", meta={"metrics": {
                "accuracy": {"value": 0.3}}}),
            "rl": ScoresRef(path="/r", fingerprint="f", benchmark="ignored", meta=summary)}
    assert eval_summary(refs) == {"eval/gsm8k/accuracy": 0.5, "eval/gsm8k/pass_at_4": 0.8,
                                  "eval/gsm8k/tool_calls": 1.25, "eval/gsm8k/em": 0.5,
                                  "heldout/rl/math/accuracy": 0.3}


def test_the_tracking_section_is_no_stages_input() -> None:
    """Switching trackers recomputes nothing: no stage's key covers the section (stages read the environment)."""
    from stages.core.stage_spec import STAGE_SPECS

    assert all("tracking" not in spec.sections for spec in STAGE_SPECS)
    stage_side = Path(__file__).resolve().parents[2] / "stages" / "core" / "tracking"
    for module in ("__init__.py", "context.py", "backends.py", "stage.py", "mlflow_backend.py", "wandb_backend.py",
                   "tensorboard_backend.py"):
        assert "stages.core.config" not in (stage_side / module).read_text(), module
