"""Our reward registry as verl's custom reward function (`reward.custom_reward_function.path=pkg://...`).

verl's reward manager calls `compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`
once per trajectory, with `solution_str` = the response decoded with skip_special_tokens=True (model text plus the
<result> blocks, as our trainer scores `response_text`) and `extra_info` = the dataset's extra_info merged with
the agent loop's extra_fields (our tree loop puts the row's `ability` there). `reward` (a reward_kwargs entry the
mapping sets) names the function in `stages.agent.rewards.REWARDS` (rl.trainer.reward). The returned extras become
verl metrics (`acc`, `f1`, `format_error`, and `infra_failures` / `masked`: the tool infrastructure failures of the
trajectory and whether they keep it out of the loss), so every value is a number.
"""

from __future__ import annotations

from typing import Any

from stages.agent.rewards import FORMAT_PENALTY, compute_rewards


def compute_score(data_source: str = "", solution_str: str = "", ground_truth: Any = "",
                  extra_info: dict[str, Any] | None = None, reward: str = "reference", **_: Any) -> dict[str, float]:
    extra = extra_info or {}
    ability = str(extra.get("ability") or "")
    truth = ground_truth if isinstance(ground_truth, str) else str(list(ground_truth))
    result = compute_rewards(reward, [solution_str], [truth], [ability])[0]
    return {"score": float(result.score), "acc": float(result.correct), "f1": float(result.f1),
            "format_error": float(result.score == FORMAT_PENALTY and result.answer is None),
            "infra_failures": float(extra.get("arpo_infra_failures") or 0),
            "masked": float(extra.get("arpo_masked") or 0)}
