"""scripts/first-gpu-day.sh (docs/gpu-runbook.md "The first GPU day"): its dry run on CPU checks every step (the
configs with their overrides, the files, the vLLM contract against the vLLM environment here) and writes the
report; the lever rule and the entropy-replica check on hand-made run outputs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from stages.core.env import PROJECT_ROOT
from tests.conftest import load_script

fgd = load_script("first_gpu_day")


def _metrics(path: Path, **split: float) -> Path:
    row = {"step": 1, **{fgd.SPLIT[k]: v for k, v in split.items()}}
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "step": 2}) + "\n")
    return path


def test_the_dry_run_checks_every_step_and_writes_the_report(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", step_s=100.0, rollout_s=60.0, generate_s=40.0, tools_s=20.0,
                       tool_queue_s=8.0, calls_per_round=60.0)
    out = tmp_path / "day"
    proc = subprocess.run([str(PROJECT_ROOT / "scripts" / "first-gpu-day.sh"), "--dry-run", "--out", str(out),
                           "--metrics", str(metrics)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = (out / "first-gpu-day.md").read_text()
    has_vllm = (PROJECT_ROOT / fgd.VLLM_PY).is_file() or (PROJECT_ROOT / fgd.VERL_PY).is_file()
    if not has_vllm and os.environ.get("CI") != "true":
        pytest.skip("no vLLM environment here (./scripts/setup-vllm.sh)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    order = [line.split(" | ")[0][2:] for line in report.splitlines() if line.startswith("| ") and " | " in line]
    assert order[1:] == ["verl-gpu-test", "served-vllm", "step-14b", "parity"]  # the runbook's order
    assert "| step-14b | one RL step of arpo-qwen3-14b-deepsearch" in report and "checked (dry run)" in report
    assert "every touched API is there" in report  # the vLLM contract, run for real against the vLLM here
    # by hand: tools 20 s, queued 8 s = 40% of the tool time >= 25%: the tool pool comes first
    assert "**Lever first: tool pool.** generate 40.0 s, tools 20.0 s of which queued 8.0 s" in report
    assert "- timing/tool_queue_s: 8.00" in report


def test_a_bad_override_fails_the_dry_run_naming_the_step(tmp_path, monkeypatch):
    steps = fgd.plan(tmp_path)
    steps[2].overrides.append("rl.trainer.total_stepz=1")
    assert not fgd.check_step(steps[2], tmp_path)
    assert steps[2].status.startswith("config: ") and "total_stepz" in steps[2].status


@pytest.mark.parametrize(("split", "expected"), [
    # queued 3 of 10 s of tools = 30% >= 25%: the pool (or the rate limit) holds calls back
    ({"generate_s": 30.0, "tools_s": 10.0, "tool_queue_s": 3.0}, "tool pool"),
    # queued 1 of 10 s (10%); tools 10 of 30 s of rollout = 33% >= 25%: the GPU waits on the tools
    ({"generate_s": 20.0, "tools_s": 10.0, "tool_queue_s": 1.0}, "async rollouts"),
    # tools 10 of 100 s = 10%, no queue: generation fills the rollout
    ({"generate_s": 90.0, "tools_s": 10.0, "tool_queue_s": 0.0}, "nothing"),
    # an engine that did not log the split
    ({"generate_s": 90.0}, "not measured"),
])
def test_the_lever_rule(split, expected):
    assert fgd.lever(split)[0] == expected


def test_the_time_split_is_step_ones(tmp_path):
    metrics = _metrics(tmp_path / "m.jsonl", generate_s=5.0, tools_s=2.0)
    assert fgd.time_split(metrics) == {"generate_s": 5.0, "tools_s": 2.0}
    assert fgd.time_split(tmp_path / "absent.jsonl") is None


def test_the_entropy_replica_is_read_from_the_run_and_a_mismatch_is_named(tmp_path):
    stage = tmp_path / "rl" / "k1"
    (stage / "verl_inputs").mkdir(parents=True)
    (stage / "verl_inputs" / "overrides.txt").write_text(
        "+ray_kwargs.ray_init.runtime_env.env_vars.ARPO_VERL_ENTROPY=surprisal\n")
    (stage / "verl.log").write_text("(vLLMHttpServer pid=1) started\n")
    assert fgd.entropy_replica(tmp_path) == ["entropy quantity `surprisal`: the replica should be verl's stock "
                                             "vLLMHttpServer", "verl.log does not name the ArpoTopk server"]
    (stage / "verl_inputs" / "overrides.txt").write_text(
        "+ray_kwargs.ray_init.runtime_env.env_vars.ARPO_VERL_ENTROPY=topk\n")
    assert "MISMATCH" in fgd.entropy_replica(tmp_path)[1]
    assert fgd.entropy_replica(tmp_path / "none") == ["no verl run folder (step-14b did not run)"]
