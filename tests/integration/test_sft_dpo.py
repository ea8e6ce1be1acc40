"""Self-critic DPO end to end on the tiny model: trajectories sampled with the RL tree rollout and real tools,
(correct, incorrect) pairs, LLaMA-Factory DPO (LoRA, sigmoid, beta 0.1), merged HF folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.agent.protocol import check_format
from stages.agent.rewards import compute_rewards
from stages.core.atomic import read_jsonl
from stages.sft import passthrough
from stages.sft.dpo import run_dpo
from tests.conftest import TEST_OUTPUTS, release_in_ci

pytestmark = [pytest.mark.integration, pytest.mark.slow]
release_outputs = release_in_ci("sft-dpo", "x")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dpo_run(tiny_config, tiny_model, synthetic_data):
    dpo = tiny_config.sft.dpo.model_copy(update=dict(enabled=True, max_questions=3, samples_per_question=2,
                                                     max_new_tokens=96, max_steps=3, per_device_train_batch_size=1,
                                                     gradient_accumulation_steps=1,
                                                     cutoff_len=1024, learning_rate=1e-4))
    cfg = tiny_config.sft.model_copy(update={"dpo": dpo, "warmup_ratio": 0.0})
    start = passthrough(tiny_model, "test: DPO straight on the base model")
    shutil.rmtree(TEST_OUTPUTS / "sft-dpo", ignore_errors=True)  # earlier code versions left their own keys
    ref = run_dpo(cfg, tiny_config.agent, start, synthetic_data, str(TEST_OUTPUTS / "sft-dpo"),
                  str(TEST_OUTPUTS.parent), force=True)
    return cfg, start, ref


def test_pairs_are_correct_versus_incorrect(dpo_run) -> None:
    _, _, ref = dpo_run
    rows = read_jsonl(Path(ref.meta["stage_dir"]) / "pairs" / "self_critic_dpo.jsonl")
    assert rows and ref.meta["metrics"]["pairs"] == len(rows) and ref.meta["metrics"]["samples"] == 6
    for row in rows:
        chosen, rejected = row["chosen"]["value"], row["rejected"]["value"]
        assert check_format(chosen).ok and chosen != rejected
        gold = chosen.split("\\boxed{")[-1].split("}")[0]
        verdicts = compute_rewards("reference", [chosen, rejected], [gold, gold], ["", ""])
        assert [v.correct for v in verdicts] == [True, False]


def test_dpo_trained_and_merged(dpo_run, tiny_model) -> None:
    _, start, ref = dpo_run
    assert ref.meta["after"] == "dpo" and ref.base == tiny_model and ref.path != start.path
    metrics = ref.meta["metrics"]
    assert metrics["steps"] == 3
    # step 1 is logged before any update: policy == reference, sigmoid DPO loss = -log sigmoid(0) = ln 2
    assert metrics["loss_first"] == pytest.approx(0.693147, abs=1e-5)
    assert metrics["loss_last"] < metrics["loss_first"]  # the chosen side gained on the rejected one
    base = load_file(str(Path(tiny_model.path) / "model.safetensors"))
    tuned = load_file(str(Path(ref.path) / "model.safetensors"))
    changed = [n for n in base if not torch.equal(base[n], tuned[n])]
    # LoRA on every linear layer of the 30 blocks (q k v o gate up down) changes exactly those weights
    assert len(changed) == 30 * 7 and all(n.endswith("proj.weight") for n in changed)


def test_disabled_dpo_returns_the_checkpoint(tiny_config, tiny_model, synthetic_data) -> None:
    start = passthrough(tiny_model, "x")
    assert run_dpo(tiny_config.sft, tiny_config.agent, start, synthetic_data, str(TEST_OUTPUTS / "x"), ".cache") \
        is start
