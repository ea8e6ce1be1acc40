"""Tool-using trajectories sampled from a checkpoint with the agent runtime's token-level driver
(stages.generation.tool_rollout.ToolRollout), for self-critic DPO pairs and the SFT format benchmark: n independent
samples per question (GRPO sampling, no branching), real tools, results inserted with `render_result`, exactly
the text RL trains on. Nothing here imports stages.rl, so RL's code does not key SFT's outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.agent.prompt_templates import build_messages
from stages.agent.protocol import check_format, count_tool_calls
from stages.core.config.agent import AgentSection
from stages.core.config.generation import DEFAULT_GENERATE_TIMEOUT_S, GenerationSettings
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.core.rl_parquet import RLRow


@dataclass(frozen=True)
class Sampled:
    question: str
    ground_truth: str
    ability: str
    responses: tuple[str, ...]


def task_rows(tasks: Sequence[dict[str, Any]], template: str) -> list[RLRow]:
    """Generated tasks (tasks.jsonl rows) as RL rows with the configured system prompt."""
    rows = []
    for i, task in enumerate(tasks):
        messages = build_messages(task["question"], template)
        rows.append(RLRow(index=i, data_source="synthetic_tir", ability=task["kind"],
                          prompt=tuple((m["role"], m["content"]) for m in messages),
                          ground_truth=str(task["answer"]), question=task["question"]))
    return rows


def sampling_settings(n: int, temperature: float, max_new_tokens: int, call_limit: int, backend: str = "transformers",
                      max_prompt_length: int = 1024) -> GenerationSettings:
    """n independent samples per prompt (a session without a growth rule does not branch); the other values are
    the rollout defaults of the RL section (RolloutSection), which this module does not import: SFT's and the
    held-out stage's keys then do not cover RL's config model."""
    return GenerationSettings(n=n, call_limit=call_limit, temperature=temperature, top_p=1.0, top_k=-1,
                              max_prompt_length=max_prompt_length, max_response_length=max_new_tokens,
                              prompt_overflow="skip", backend=backend, kv_reuse=True, entropy_quantity="topk",
                              entropy_topk=10, generate_timeout_s=DEFAULT_GENERATE_TIMEOUT_S)


def sample(policy: ModelRef | CheckpointRef, tasks: Sequence[dict[str, Any]], agent: AgentSection, data: DatasetRef,
           cache_root: str | Path, rollout: GenerationSettings, seed: int = 0,
           questions_per_batch: int = 8) -> list[Sampled]:
    """`rollout.n` trajectories for every task, with the real toolbox."""
    from stages.generation.models import load_policy, load_tokenizer
    from stages.generation.session import RolloutSession

    tokenizer = load_tokenizer(policy)
    model = load_policy(policy).eval()
    session = RolloutSession(rollout, agent, model, tokenizer, data, Path(cache_root), seed=seed)
    out: list[Sampled] = []
    try:
        rows = task_rows(tasks, agent.prompt_template)
        for start in range(0, len(rows), questions_per_batch):
            batch = session.rollout(rows[start:start + questions_per_batch], seed=seed + start)
            out += [Sampled(g.question, g.ground_truth, g.ability, tuple(t.response_text for t in g.trajectories))
                    for g in batch.groups]
    finally:
        session.close()
    return out


def format_metrics(sampled: Sequence[Sampled], reward: str = "reference") -> dict[str, float]:
    """Format-valid rate (check_format), tool-call rate (>= 1 complete call), accuracy (reward's `correct`)."""
    from stages.agent.rewards import compute_rewards

    responses = [r for s in sampled for r in s.responses]
    golds = [s.ground_truth for s in sampled for _ in s.responses]
    abilities = [s.ability for s in sampled for _ in s.responses]
    if not responses:
        raise ValueError("no sampled responses to measure")
    rewards = compute_rewards(reward, responses, golds, abilities)
    n = len(responses)
    return {"responses": n,
            "format_valid": sum(check_format(r).ok for r in responses) / n,
            "tool_call": sum(sum(count_tool_calls(r).values()) > 0 for r in responses) / n,
            "accuracy": sum(w.correct for w in rewards) / n,
            "mean_reward": sum(w.score for w in rewards) / n}
