"""Held-out accuracy of one policy, in process, with the RL tree rollout and real tools: a small cached stage.

    ref = evaluate_heldout(HeldoutSection(max_questions=96), agent, policy, data, output_root, cache_root)
    ref.meta["accuracy"], ref.meta["ci_low"], ref.meta["ci_high"]

The questions are a held-out split of the data stage (`eval_test`: the generated test split, never seen by the
teacher SFT or by RL; or `rl_valid`). Each question gets `samples` trajectories (GRPO strategy, no branching) at
`temperature` (0 = greedy), with the agent's tools, results inserted exactly as in RL; the reward function
(`reward`, the RL registry) decides `correct` per trajectory. Accuracy = mean over questions of the fraction of
correct samples; its interval is a seeded percentile bootstrap over questions (samples of one question stay
together). Also reported: format-valid rate, tool calls per trajectory, mean reward, response length.

Output `<output_root>/heldout/<key>/` (key = spec, agent section, policy and data fingerprints, code of this module,
stages.rl and stages.agent): `predictions.jsonl` (one row per question with every response and verdict) and
`summary.json`; cached like every stage, so base, SFT and RL policies are each evaluated once per split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stages.core.atomic import read_jsonl, write_json, write_jsonl
from stages.core.codeversion import code_version
from stages.core.config.agent import AgentSection
from stages.core.config.eval import HeldoutSection
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.passk import bootstrap_ci
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef, ScoresRef
from stages.core.workspace import stage_dir

log = get_logger(__name__)


def heldout_rows(spec: HeldoutSection, agent: AgentSection, data: DatasetRef) -> list[Any]:
    """The split as RL rows (RLRow), in file order, the first `max_questions`."""
    from stages.core.rl_parquet import read_rl_parquet
    from stages.generation.samples import task_rows

    if spec.split == "rl_valid":
        rows = read_rl_parquet(data.file("rl_valid"))
    else:
        tasks = read_jsonl(data.file("eval_test"))
        for i, task in enumerate(tasks):
            if not {"question", "answer"} <= set(task):
                raise ValueError(f"{data.file('eval_test')} row {i}: needs question and answer; regenerate it "
                                 "with the data stage")
        rows = task_rows([{"kind": t.get("kind", "qa"), **t} for t in tasks], agent.prompt_template)
    rows = rows[: spec.max_questions]
    if not rows:
        raise ValueError(f"held-out split {spec.split} of {data.path} has no questions")
    return rows


def summarize_verdicts(correct_QN: np.ndarray, spec: HeldoutSection) -> dict[str, float]:
    """Accuracy (mean over questions of the per-question fraction correct) and its bootstrap interval."""
    value_Q = np.asarray(correct_QN, dtype=float).mean(axis=1)
    low, high = bootstrap_ci(value_Q, samples=spec.bootstrap_samples, confidence=spec.confidence, seed=spec.seed)
    return {"accuracy": float(value_Q.mean()), "ci_low": low, "ci_high": high}


def heldout_key(spec: HeldoutSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef) -> str:
    """The stage's one key (its folder name and its Prefect cache key). `enabled` only switches the stage on."""
    return hash_value(spec.model_dump(exclude={"enabled"}), agent, policy.fingerprint, data.fingerprint,
                      code_version(__name__))


def evaluate_heldout(spec: HeldoutSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
                     output_root: str | Path, cache_root: str | Path, force: bool = False) -> ScoresRef:
    """Accuracy of `policy` on the held-out split with an interval (see the module doc); cached per policy."""
    out = stage_dir(output_root, "heldout", heldout_key(spec, agent, policy, data), force=force)
    if not out.complete:
        summary = _run(spec, agent, policy, data, out.path, Path(cache_root))
        out.finish(summary=summary)
    summary = out.marker()["summary"]
    return ScoresRef(path=str(out.path / "summary.json"), fingerprint=out.fingerprint, benchmark=spec.split,
                     meta=summary)


def _run(spec: HeldoutSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
         folder: Path, cache_root: Path) -> dict[str, Any]:
    from stages.agent.protocol import check_format
    from stages.agent.rewards import compute_rewards
    from stages.generation.models import load_policy, load_tokenizer
    from stages.generation.samples import sampling_settings
    from stages.generation.session import RolloutSession

    rows = heldout_rows(spec, agent, data)
    settings = sampling_settings(n=spec.samples, temperature=spec.temperature, max_new_tokens=spec.max_response_length,
                          call_limit=spec.call_limit, max_prompt_length=spec.max_prompt_length,
                          backend=spec.backend)
    model = load_policy(policy).eval()
    session = RolloutSession(settings, agent, model, load_tokenizer(policy), data, cache_root, seed=spec.seed)
    records: list[dict[str, Any]] = []
    try:
        for start in range(0, len(rows), spec.questions_per_batch):
            batch = session.rollout(rows[start:start + spec.questions_per_batch], seed=spec.seed + start)
            for group in batch.groups:
                trajs = group.trajectories
                rewards = compute_rewards(spec.reward, [t.response_text for t in trajs],
                                          [group.ground_truth] * len(trajs), [group.ability] * len(trajs))
                records.append({"question": group.question, "answer": group.ground_truth, "ability": group.ability,
                                "responses": [t.response_text for t in trajs],
                                "correct": [bool(r.correct) for r in rewards], "reward": [r.score for r in rewards],
                                "format_ok": [check_format(t.response_text).ok for t in trajs],
                                "tool_calls": [sum(t.tool_calls.values()) for t in trajs],
                                "length": [len(t) for t in trajs]})
            log.info("held-out: %d/%d questions", len(records), len(rows))
    finally:
        session.close()
    write_jsonl(folder / "predictions.jsonl", records)
    summary = {**summarize_verdicts(np.array([r["correct"] for r in records]), spec),
               "questions": len(records), "samples": spec.samples, "temperature": spec.temperature,
               "confidence": spec.confidence, **_means(records)}
    write_json(folder / "summary.json", summary)
    return summary


def _means(records: list[dict[str, Any]]) -> dict[str, float]:
    def mean(key: str) -> float:
        values = [float(v) for r in records for v in r[key]]
        return sum(values) / len(values)

    return {"format_valid": mean("format_ok"), "tool_calls_per_traj": mean("tool_calls"),
            "mean_reward": mean("reward"), "response_length": mean("length")}


__all__ = ["evaluate_heldout", "heldout_key", "heldout_rows", "summarize_verdicts"]
