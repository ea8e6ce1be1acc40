"""Self-critic DPO pairs: (correct, incorrect) for the same question; teacher and gold fallbacks; the questions (task set
or RL parquet); ranking file rows; Tool-Star's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.core.rl_parquet import DatasetRowError
from stages.generation.samples import Sampled, format_metrics, sampling_settings
from stages.sft.dpo import preference_pairs, ranking_row

GOOD = "<think> x </think>\n<answer> The final answer is \\[ \\boxed{4} \\] </answer>"
WRONG = "<think> x </think>\n<answer> The final answer is \\[ \\boxed{5} \\] </answer>"
BROKEN = "4"


def test_pairs_take_correct_vs_incorrect_of_the_same_question() -> None:
    sampled = [Sampled("q1", "4", "math", (GOOD, WRONG, BROKEN, GOOD)), Sampled("q2", "4", "math", (WRONG, WRONG))]
    correct = [[True, False, False, True], [False, False]]
    rows = preference_pairs(sampled, correct, "SYS", pairs_per_question=5)
    # q1: one distinct correct text, two distinct incorrect ones -> 2 pairs; q2: no correct sample, no fallback
    assert len(rows) == 2
    assert all(r["chosen"] == {"from": "gpt", "value": GOOD} for r in rows)
    assert {r["rejected"]["value"] for r in rows} == {WRONG, BROKEN}
    assert rows[0]["conversations"] == [{"from": "human", "value": "q1"}] and rows[0]["system"] == "SYS"
    assert len(preference_pairs(sampled, correct, "SYS", pairs_per_question=1)) == 1


def test_teacher_fallback_gives_a_chosen_side_when_no_sample_is_right() -> None:
    sampled = [Sampled("q2", "4", "math", (WRONG, BROKEN))]
    rows = preference_pairs(sampled, [[False, False]], "SYS", 2, fallback={"q2": GOOD})
    assert [(r["chosen"]["value"], r["rejected"]["value"]) for r in rows] in ([(GOOD, WRONG), (GOOD, BROKEN)],
                                                                              [(GOOD, BROKEN), (GOOD, WRONG)])
    # all samples correct: nothing to reject, no pair
    assert preference_pairs([Sampled("q", "4", "math", (GOOD,))], [[True]], "SYS", 2, fallback={"q": GOOD}) == []


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError):
        preference_pairs([Sampled("q", "4", "math", (GOOD,))], [], "SYS", 1)


def test_ranking_file_rows_are_validated(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    raw = {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": GOOD},
           "rejected": {"from": "gpt", "value": WRONG}, "system": "SYS"}
    assert ranking_row(path, 0, raw) == {"conversations": [{"from": "human", "value": "q"}], "system": "SYS",
                                         "chosen": {"from": "gpt", "value": GOOD},
                                         "rejected": {"from": "gpt", "value": WRONG}}
    with pytest.raises(DatasetRowError, match="row 3: a preference row needs"):
        ranking_row(path, 3, {"conversations": raw["conversations"], "chosen": GOOD})
    with pytest.raises(DatasetRowError, match="'rejected' must hold"):
        ranking_row(path, 0, {**raw, "rejected": {"from": "gpt", "value": " "}})


def test_format_metrics_with_the_reference_reward() -> None:
    tool = ("<think> x </think>\n<python>\nprint(2+2)\n</python> <result>\n4\n</result>\n"
            "<think> y </think>\n<answer> \\boxed{4} </answer>")
    sampled = [Sampled("q", "4", "math", (tool, WRONG, BROKEN, GOOD))]
    metrics = format_metrics(sampled)
    # 3 of 4 pass check_format (BROKEN has no tags); 1 of 4 calls a tool; tool and GOOD are exactly right
    assert metrics["responses"] == 4
    assert metrics["format_valid"] == 0.75 and metrics["tool_call"] == 0.25 and metrics["accuracy"] == 0.5
    # rewards: 1.0 + 0 + (-1) + 1.0 -> mean 0.25
    assert metrics["mean_reward"] == pytest.approx(0.25)


def test_sampling_settings_are_plain_independent_samples() -> None:
    from stages.core.config.rl import RolloutSection

    settings = sampling_settings(n=4, temperature=1.0, max_new_tokens=128, call_limit=3)
    assert (settings.n, settings.call_limit, settings.max_response_length) == (4, 3, 128)
    # every other value is the RL section's default, as when this built a grpo RolloutSection
    same = RolloutSection(n=4, initial_rollouts=4, call_limit=3, max_prompt_length=1024, max_response_length=128,
                          temperature=1.0, prompt_overflow="skip").generation()
    assert settings == same


def test_gold_fallback_is_a_correct_answer_without_tools() -> None:
    from stages.agent.protocol import check_format, minimal_answer
    from stages.agent.rewards import compute_rewards

    gold = minimal_answer("Frank Lowy")
    # the reference reward: format ok, F1 = 1 against the gold, no tool so no +0.1 bonus -> exactly 1.0, correct
    assert check_format(gold).ok
    assert [(r.score, r.correct) for r in compute_rewards("reference", [gold], ["Frank Lowy"], ["qa"])] == [(1.0, True)]
    rows = preference_pairs([Sampled("q", "Frank Lowy", "qa", (WRONG,))], [[False]], "SYS", 1, fallback={"q": gold})
    assert [(r["chosen"]["value"], r["rejected"]["value"]) for r in rows] == [(gold, WRONG)]


def test_dpo_questions_come_from_the_task_set_or_the_rl_parquet(tmp_path: Path) -> None:
    from stages.core.atomic import write_jsonl
    from stages.core.refs import DatasetRef
    from stages.core.rl_parquet import make_row, write_rl_parquet
    from stages.sft.dpo import dpo_questions

    rows = [make_row(i, "DR_grpo_mix", kind, "SYS", f"question {i}", f"answer {i}", "train")
            for i, kind in enumerate(("math", "qa", "math"))]
    parquet = write_rl_parquet(rows, tmp_path / "rl_train.parquet")
    real = DatasetRef(path=str(tmp_path), fingerprint="x", files={"rl_train": str(parquet)})
    # a parquet (Tool-Star's RL questions): its first rows, in file order, with their ground truths and abilities
    assert dpo_questions(real, 2) == [{"id": 0, "kind": "math", "question": "question 0", "answer": "answer 0"},
                                      {"id": 1, "kind": "qa", "question": "question 1", "answer": "answer 1"}]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [
        {"id": "t1", "kind": "math", "question": "q1", "answer": "1", "split": "test"},
        {"id": "t2", "kind": "qa", "question": "q2", "answer": "2", "split": "train"}])
    synthetic = DatasetRef(path=str(tmp_path), fingerprint="y", files={"rl_train": str(parquet), "tasks": str(tasks)})
    # the generated task set wins where there is one: its train split only
    assert [t["id"] for t in dpo_questions(synthetic, None)] == ["t2"]


def test_dpo_defaults_are_toolstars_and_the_teacher_needs_the_task_set() -> None:
    from stages.core.config.loader import ConfigError, load_config
    from stages.core.config.sft import DPOSection

    dpo = DPOSection()
    # qwen_lora_dpo_2.yaml 30-31: per-device batch 2, accumulation 2
    assert (dpo.per_device_train_batch_size, dpo.gradient_accumulation_steps) == (2, 2)
    with pytest.raises(ConfigError, match="chosen_fallback=gold"):
        load_config("arpo-qwen2.5-7b-reasoning", ["sft.dpo.enabled=true"])   # a parquet profile, teacher default
    assert load_config("arpo-qwen2.5-7b-reasoning", ["sft.dpo.enabled=true", "sft.dpo.chosen_fallback=gold"])
