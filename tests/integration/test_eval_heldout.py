"""Held-out evaluation of a policy (stages.heldout) on the real tiny model, real tools, the generated test split."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.agent.rewards import compute_rewards
from stages.core.atomic import read_jsonl
from stages.core.config.eval import HeldoutSection
from stages.heldout import evaluate_heldout

pytestmark = pytest.mark.integration


def test_heldout_scores_every_sample_and_is_cached_per_policy(tiny_model, synthetic_data, tiny_config,
                                                             tmp_path: Path) -> None:
    spec = HeldoutSection(max_questions=3, samples=2, temperature=1.0, max_response_length=48, call_limit=1,
                       questions_per_batch=2)
    ref = evaluate_heldout(spec, tiny_config.agent, tiny_model, synthetic_data, tmp_path, tmp_path / "cache")
    rows = read_jsonl(Path(ref.path).with_name("predictions.jsonl"))
    tests = read_jsonl(synthetic_data.file("eval_test"))[:3]
    assert [r["question"] for r in rows] == [t["question"] for t in tests]   # the test split, in file order
    assert all(len(r["responses"]) == len(r["correct"]) == 2 for r in rows)
    for row in rows:  # the verdicts are the reward function's, recomputed from the stored text
        rewards = compute_rewards("reference", row["responses"], [row["answer"]] * 2, [row["ability"]] * 2)
        assert row["correct"] == [w.correct for w in rewards] and row["reward"] == [w.score for w in rewards]
    meta = ref.meta
    fractions = [sum(r["correct"]) / 2 for r in rows]
    assert meta["accuracy"] == pytest.approx(sum(fractions) / 3) and meta["questions"] == 3
    assert 0.0 <= meta["ci_low"] <= meta["accuracy"] <= meta["ci_high"] <= 1.0
    # a second call is a cache hit: same fingerprint, nothing rewritten
    mtime = Path(ref.path).stat().st_mtime_ns
    again = evaluate_heldout(spec, tiny_config.agent, tiny_model, synthetic_data, tmp_path, tmp_path / "cache")
    assert again.fingerprint == ref.fingerprint and Path(again.path).stat().st_mtime_ns == mtime
