"""The RL trainer on the tiny model with the real tree rollout and toolbox.

- one step changes every trainable parameter (TRL-style), for plain GRPO and for AEPO with every option on
  (balanced clipping, entropy-aware hard-attributed advantages, KL to a frozen reference, entropy bonus);
- a trainer subprocess killed with SIGKILL after its first checkpoint resumes in the same stage folder and
  finishes at the same step count with every step in metrics.jsonl exactly once;
- run_rl passes the policy through when RL is disabled.

Budgets are tiny (1 prompt x 2 trajectories, 16 response tokens) to keep the suite short on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages.agent.rewards import REWARDS, Reward
from stages.core.atomic import read_jsonl
from stages.core.config.loader import load_config
from stages.core.env import PROJECT_ROOT
from stages.rl.stage import run_rl
from stages.rl.trainer import RLTrainer

pytestmark = pytest.mark.integration
torch.set_num_threads(1)
CACHE = PROJECT_ROOT / ".cache"
TINY = ["rl.rollout.n=2", "rl.rollout.initial_rollouts=1", "rl.trainer.train_batch_size=1",
        "rl.trainer.ppo_mini_batch_size=1", "rl.trainer.micro_batch_size=2", "rl.rollout.max_response_length=16",
        "rl.rollout.call_limit=1"]


@REWARDS.register("test_vowels")
def vowels(responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]:
    """A reward that differs between any two samples, so every group carries a learning signal."""
    scores = []
    for text in responses:
        letters = [c for c in text.lower() if c.isalpha()]
        scores.append(sum(c in "aeiou" for c in letters) / max(1, len(letters)))
    return [Reward(s, False, "vowel fraction", None, 0.0) for s in scores]


def _initial_params(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("algo", [
    ["rl.algorithm=grpo", "rl.rollout.initial_rollouts=2"],
    ["rl.algorithm=aepo", "rl.rollout.branch_penalty=0.05",
     "rl.loss.policy_loss=aepo_balanced_clip", "rl.advantage.entropy_aware=true", "rl.advantage.attribution=hard",
     "rl.loss.kl_coef=0.1", "rl.loss.entropy_coef=0.01", "rl.loss.aggregation=seq_mean_token_mean"],
], ids=["grpo", "aepo-all-options"])
def test_one_step_changes_every_parameter(tiny_model, synthetic_data, tmp_path, algo):
    cfg = load_config("tiny-cpu", overrides=TINY + algo + [
        "rl.trainer.total_steps=1", "rl.trainer.reward=test_vowels", "rl.optim.weight_decay=0", "rl.optim.lr=1e-5"])
    before = _initial_params(tiny_model.path)
    trainer = RLTrainer(cfg.rl, cfg.agent, tiny_model, synthetic_data, tmp_path, CACHE, seed=0)
    final = trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p.detach().cpu())]
    assert not unchanged, f"parameters not updated by one step: {unchanged[:5]}"
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert row["step"] == 1 and row["optimizer_steps"] == 1.0 and row["grad_norm"] > 0
    assert row["reward/std"] > 0 and row["rollout/trajectories"] == 2.0
    assert row["rollout/logp_mismatch"] < 1e-3  # the trainer recomputes what the rollout sampled with
    assert (trainer.ref_model is not None) == (cfg.rl.loss.kl_coef > 0)  # reference loaded only when used
    if cfg.rl.loss.kl_coef > 0:
        assert row["kl"] >= 0 and "kl/ref" in row
    assert (final / "model" / "model.safetensors").is_file() and (final / "probe.json").is_file()
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "rollouts" / "step_000001.jsonl").is_file()


RUNNER = """
import json, sys
import torch
from stages.core.env import configure_environment
configure_environment()
torch.set_num_threads(1)
from stages.core.config.loader import load_config
from stages.core.refs import DatasetRef, ModelRef
from stages.rl.stage import run_rl
args = json.loads(sys.argv[1])
cfg = load_config("tiny-cpu", overrides=args["overrides"])
ref = run_rl(cfg.rl, cfg.agent, ModelRef.model_validate(args["model"]), DatasetRef.model_validate(args["data"]),
             args["out"], args["cache"], seed=0)
print("RESULT " + ref.model_dump_json())
"""


def _spawn(args: dict, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(args)], cwd=PROJECT_ROOT, env=env,
                                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_stale_sampler_raises_the_drift_alarm_and_stops(tiny_model, synthetic_data, tmp_path, monkeypatch):
    """A sampler that holds its own copy of the weights and never receives the update (what vLLM's refresh did to a
    tied head before issue 37): step 1 samples from the same weights (mismatch ~0), step 2 from the step-0 weights
    while the trainer has moved; sampler_drift fires and, in the default stop_on, ends the run before step 2 is
    saved."""
    import copy

    import stages.generation.session as session
    from stages.rl.alarms import AlarmStop

    real = session.load_backend

    def stale_backend(name, model, tokenizer, **opts):  # the trainer's weights as they are now, never refreshed
        return real(name, copy.deepcopy(model).requires_grad_(False), tokenizer, **opts)

    monkeypatch.setattr(session, "load_backend", stale_backend)
    cfg = load_config("tiny-cpu", overrides=TINY + ["rl.trainer.total_steps=2", "rl.trainer.reward=test_vowels",
                                                    "rl.optim.lr=1e-4", "rl.trainer.save_every=1"])
    with pytest.raises(AlarmStop, match="step 2: alarm sampler_drift"):
        RLTrainer(cfg.rl, cfg.agent, tiny_model, synthetic_data, tmp_path, CACHE, seed=0).train()
    # the untrained tiny policy calls no tool at step 1 of a tools profile: tool_unused warns there (not in stop_on)
    alarms = [(a["name"], a["step"]) for a in read_jsonl(tmp_path / "alarms.jsonl")]
    assert [a for a in alarms if a[0] != "tool_unused"] == [("sampler_drift", 2)]
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")  # step 2 was not saved
    assert row["step"] == 1 and row["rollout/logp_mismatch"] < 1e-4


def test_sigkill_after_first_checkpoint_then_resume(tiny_model, synthetic_data, tmp_path):
    args = {"overrides": TINY + ["rl.algorithm=arpo", "rl.trainer.total_steps=2", "rl.trainer.save_every=1"],
            "model": tiny_model.model_dump(), "data": synthetic_data.model_dump(), "out": str(tmp_path / "out"),
            "cache": str(CACHE)}
    first = _spawn(args, tmp_path / "first.log")
    deadline = time.time() + 480
    try:
        while not list((tmp_path / "out").glob("rl/*/checkpoints/step_000001/state.json")):
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint after 8 minutes"
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the trainer and any tool sandbox it started
        first.wait()
    stage = next((tmp_path / "out").glob("rl/*"))
    assert not (stage / "_COMPLETE.json").exists()
    steps_before = [r["step"] for r in read_jsonl(stage / "metrics.jsonl")]
    second = _spawn(args, tmp_path / "second.log")
    try:
        assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    log = (tmp_path / "second.log").read_text()
    match = re.search(r"resuming from \S+ \(step (\d+)\)", log)
    assert match, log[-3000:]
    resumed = int(match.group(1))
    assert resumed >= 1
    rows = read_jsonl(stage / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # same step count, no step twice, none missing
    assert {r["pid"] for r in rows if r["step"] <= resumed} == {first.pid}
    assert {r["pid"] for r in rows if r["step"] > resumed} == {second.pid}
    assert all(r["resumed_from"] == resumed for r in rows if r["step"] > resumed)
    assert steps_before[: resumed] == list(range(1, resumed + 1))
    result = json.loads(log.split("RESULT ")[1].strip().splitlines()[0])
    assert result["format"] == "trainer" and result["step"] == 2
    assert Path(result["path"]).name == "step_000002" and (stage / "_COMPLETE.json").is_file()


def test_disabled_rl_passes_the_policy_through(tiny_model, synthetic_data, tmp_path):
    cfg = load_config("tiny-cpu", overrides=["rl.enabled=false"])
    ref = run_rl(cfg.rl, cfg.agent, tiny_model, synthetic_data, tmp_path, CACHE)
    assert (ref.format, ref.path, ref.base) == ("hf", tiny_model.path, tiny_model)
    assert not (tmp_path / "rl").exists()
