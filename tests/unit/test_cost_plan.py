"""`arpo plan`: the estimate's arithmetic (hand-derived), the measured-run look-up by per-step identity, the CLI.
Checked against a real tiny RL run in tests/integration/test_rl_outage.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core.atomic import write_jsonl
from stages.core.config.loader import load_config
from stages.cost import estimate, measured_run, plan_run, render_markdown, step_identity
from stages.cost.basis import read_measured
from stages.rl.step_identity import IDENTITY_FILE, write_identity


def _lines(est) -> dict[str, tuple]:
    return {line.what: (line.per_step, line.per_run, line.basis) for line in est.lines}


def test_bounds_from_the_tiny_profile():
    # tiny-cpu: 2 steps x 2 prompts x n = 4; 256 response tokens; call_limit 2 (max_calls 5); eval 4 questions x 2
    cfg = load_config("tiny-cpu", ["cost.step_seconds=120", f"run.output_root={Path('/nonexistent')}"])
    est = estimate(cfg, train_rows=84, measured=None, eval_questions={"synthetic": 4})
    lines = _lines(est)
    assert est.steps == 2 and lines["prompts"] == (2, 4, "exact") and lines["trajectories"] == (8, 16, "exact")
    assert lines["generated tokens"] == (8 * 256, 2 * 8 * 256, "bound")
    assert lines["tool calls"] == (8 * 2, 32, "bound") and lines["search calls"] == (16, 32, "bound")
    assert lines["device-hours"] == (120 / 3600, 2 * 120 / 3600, "given")
    assert lines["eval answers"] == (None, 8, "exact") and lines["eval search calls"] == (None, 80, "bound")
    assert "search requests (all retried)" not in lines          # a local index: no provider, no bill
    assert "upper bound" in render_markdown(est) and "84 training prompts; 2 RL steps" in est.assumptions[0]


def test_paper_profile_search_bill_and_devices():
    # arpo 7B: 128 prompts x 16 = 2048 trajectories, <= 3 calls each -> 6144 search calls per step;
    # 10_000 rows // 128 = 78 steps per epoch x 2 epochs = 156 steps; web search retried 3x; 8 GPUs
    cfg = load_config("arpo-qwen2.5-7b-reasoning", ["cost.search_price_per_1000=2.0", "cost.step_seconds=900"])
    lines = _lines(estimate(cfg, train_rows=10_000))
    assert lines["search calls"] == (6144, 6144 * 156, "bound")
    assert lines["search requests (all retried)"][:2] == (3 * 6144, 3 * 6144 * 156)
    assert lines["search cost"][:2] == pytest.approx((6144 * 2.0 / 1000, 6144 * 156 * 2.0 / 1000))
    assert lines["device-hours"][:2] == pytest.approx((900 * 8 / 3600, 156 * 900 * 8 / 3600))
    unknown = _lines(estimate(cfg.model_copy(update={"cost": cfg.cost.model_copy(update={"step_seconds": None})}),
                              train_rows=None))
    assert unknown["prompts"] == (128, None, "exact") and unknown["device-hours"][2] == "unknown"


def _measured_folder(root: Path, cfg, name: str, identity: str | None = None) -> Path:
    folder = root / "rl" / name
    folder.mkdir(parents=True)
    write_identity(folder, identity or step_identity(cfg.rl, cfg.agent, cfg.model.name, cfg.model.dtype))
    write_jsonl(folder / "metrics.jsonl", [
        {"step": 1, "rollout/trajectories": 8.0, "response/model_tokens": 100.0, "rollout/tool_calls_executed": 6.0,
         "rollout/search_calls_executed": 4.0, "timing/step_s": 100.0},
        {"step": 2, "rollout/trajectories": 8.0, "response/model_tokens": 120.0, "rollout/tool_calls_executed": 10.0,
         "rollout/search_calls_executed": 6.0, "timing/step_s": 140.0}])
    return folder


def test_a_measured_short_run_is_found_by_its_per_step_settings(tmp_path: Path):
    # the short run had 2 steps; the planned run has 10 (and other alarms / lr): the same per-step identity
    short = load_config("tiny-cpu", [f"run.output_root={tmp_path}"])
    planned = load_config("tiny-cpu", [f"run.output_root={tmp_path}", "rl.trainer.total_steps=10",
                                       "rl.optim.lr=3e-6", "rl.alarms.infra_share=0.5"])
    other = load_config("tiny-cpu", ["rl.rollout.n=2", "rl.rollout.initial_rollouts=1"])
    _measured_folder(tmp_path, other, "other-settings",
                     step_identity(other.rl, other.agent, other.model.name, other.model.dtype))
    folder = _measured_folder(tmp_path, short, "short-run")
    assert step_identity(planned.rl, planned.agent, "m", "float32") == step_identity(short.rl, short.agent, "m",
                                                                                     "float32")
    assert measured_run(planned).source == str(folder / "metrics.jsonl")
    lines = _lines(plan_run(planned))
    # means of the 2 measured steps, x 10 steps: tokens (100 + 120) / 2 x 8 trajectories = 880 per step
    assert lines["generated tokens"] == (880.0, 8800.0, "measured")
    assert lines["tool calls"] == (8.0, 80.0, "measured") and lines["search calls"] == (5.0, 50.0, "measured")
    assert lines["device-hours"] == (120 / 3600, 10 * 120 / 3600, "measured")
    assert plan_run(planned).line("tool calls").error == planned.cost.tolerance
    assert measured_run(other.model_copy(update={"run": planned.run})).source.endswith("other-settings/metrics.jsonl")
    (folder / IDENTITY_FILE).unlink()
    assert measured_run(planned) is None
    with pytest.raises(FileNotFoundError, match="cost.measured"):
        read_measured(tmp_path / "nowhere")


def test_arpo_plan_prints_the_estimate(capsys):
    from flows.cli import main

    assert main(["plan", "-p", "tiny-cpu", "--json", "-o", "run.output_root=/nonexistent"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 2 and printed["lines"][0] == {"what": "prompts", "per_step": 2, "per_run": 4,
                                                             "basis": "exact", "error": 0.0, "note": ""}
    assert main(["plan", "-p", "tiny-cpu", "-o", "run.output_root=/nonexistent"]) == 0
    assert "| trajectories | 8 | 16 | exact |" in capsys.readouterr().out


def test_tool_time_against_generate_time_says_when_a_step_is_tool_bound():
    # aepo 14B on verl: 64 prompts x 12 = 768 trajectories x <= 6 calls = 4608 calls per step over 6 call rounds
    # and 8 agent-loop workers: 96 calls per round per worker -> ceil(96 / 64) = 2 waves of 1.5 s -> 6 x 2 x 1.5 =
    # 18 s of tools, 6 x 1 x 1.5 = 9 s queueing; web search at 2 requests/s: 4608 / 2 = 2304 s floor; generate:
    # 6192 tokens / 30 tokens/s = 206.4 s -> tool-bound by the rate limit
    lines = _lines(est := estimate(load_config("aepo-qwen3-14b-deepsearch"), train_rows=None))
    assert lines["tool calls per round per worker"][0] == 96
    assert lines["tool queueing (s)"][0] == 9 and lines["web rate-limit floor (s)"][0] == 2304
    assert lines["generate time (s)"][0] == pytest.approx(206.4) and lines["tool time (s)"][0] == 2304
    assert est.verdict.startswith("**Tool-bound**") and "web rate limit" in est.verdict
    assert est.verdict in render_markdown(est)
    # a local index: the pool alone, 18 s < 206.4 s -> not tool-bound ...
    local = estimate(load_config("aepo-qwen3-14b-deepsearch", ["agent.search.backend=local"]), train_rows=None)
    assert _lines(local)["tool time (s)"][0] == 18 and local.verdict.startswith("Not tool-bound")
    # ... but with the old 4 threads: ceil(96 / 4) = 24 waves -> 6 x 24 x 1.5 = 216 s, 207 s of it queueing
    four = estimate(load_config("aepo-qwen3-14b-deepsearch", ["agent.search.backend=local", "agent.concurrency=4"]),
                    train_rows=None)
    assert _lines(four)["tool time (s)"][0] == 216 and _lines(four)["tool queueing (s)"][0] == 207
    assert "raise agent.concurrency" in four.verdict


def test_a_measured_split_replaces_the_assumed_speeds(tmp_path: Path):
    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": 1, "timing/generate_s": 100.0, "timing/tools_s": 300.0, "timing/tool_queue_s": 200.0,
         "tools/calls_per_round": 40.0},
        {"step": 2, "timing/generate_s": 120.0, "timing/tools_s": 340.0, "timing/tool_queue_s": 220.0,
         "tools/calls_per_round": 44.0}])
    cfg = load_config("aepo-qwen3-14b-deepsearch", [f"cost.measured={tmp_path}"])
    est = estimate(cfg, train_rows=None, measured=read_measured(tmp_path))
    lines = _lines(est)
    assert lines["generate time (s)"] == (110.0, None, "measured") and lines["tool time (s)"][0] == 320.0
    assert lines["tool queueing (s)"][0] == 210.0 and lines["tool calls per round per worker"][0] == 42.0
    assert "raise agent.concurrency" in est.verdict


def test_a_plan_generates_the_synthetic_world_once(monkeypatch: pytest.MonkeyPatch):
    # the train rows and the synthetic benchmark's questions both come from one generation of the task world
    from stages.cost import inputs
    from stages.data import synthetic

    calls = []
    real = synthetic.generate
    monkeypatch.setattr(synthetic, "generate", lambda section: calls.append(section) or real(section))
    inputs._synthetic_splits.cache_clear()
    cfg = load_config("tiny-cpu", [f"run.output_root={Path('/nonexistent')}"])
    world = real(cfg.data.synthetic)
    est = plan_run(cfg, measured=None)
    assert len(calls) == 1
    train = sum(task.split == "train" for task in world.tasks)
    assert f"{train} training prompts" in est.assumptions[0]
    inputs._synthetic_splits.cache_clear()
