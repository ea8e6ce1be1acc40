"""Optional self-critic DPO after SFT (Tool-Star: LLaMA-Factory DPO, LoRA r 8, beta 0.1, sigmoid loss).

Pairs: for each train question (the generated task set's train split, else the first rows of the RL train
parquet, as Tool-Star samples its RL questions) the SFT checkpoint samples `samples_per_question` tool trajectories
with the agent runtime (stages.generation: the rollout loop RL runs, without branching); the reward function
(`reference` by default) marks each correct or not; a pair is (correct, incorrect) for the same question. When no
sample of a question is correct, `chosen_fallback` decides: `teacher` (the generated task set only) takes that
question's teacher trajectory (real tools, gold answer) as the chosen side, so a small model that is rarely right
still gets pairs; `gold` a minimal well-formed answer with its ground truth; `none` gives no pair (Tool-Star).
Output: the LoRA merged into a plain HF folder.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.agent.prompt_templates import system_prompt
from stages.agent.protocol import minimal_answer
from stages.core import tracking
from stages.core.atomic import write_json
from stages.core.codeversion import code_version
from stages.core.config.agent import AgentSection
from stages.core.config.sft import SFTSection
from stages.core.errors import BadInputError
from stages.core.fingerprint import hash_value
from stages.core.input_files import hash_input
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef, DatasetRef
from stages.core.rl_parquet import read_rl_parquet
from stages.core.workspace import StageDir, stage_dir
from stages.generation.samples import Sampled, sample, sampling_settings
from stages.sft import lf_config
from stages.sft.dataset import teacher_report
from stages.sft.formats import read_records, sharegpt_row, write_lf_dataset
from stages.sft.runner import bin_dir, resume_point, run_config, subprocess_env, training_metrics
from stages.sft.stage import check_hf_folder, local_path, merge_lora, preflight, teacher_key_inputs, template_of
from stages.sft.teacher import train_tasks

log = get_logger(__name__)

PAIRS_NAME = "self_critic_dpo"


def preference_pairs(sampled: Sequence[Sampled], correct: Sequence[Sequence[bool]], system: str,
                     pairs_per_question: int, fallback: dict[str, str] | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Sharegpt ranking rows (conversations / chosen / rejected / system): (correct, incorrect) per question.

    `fallback`: question -> a known-correct trajectory used as `chosen` when no sample was correct.
    Identical chosen/rejected texts are never paired.
    """
    rng = random.Random(seed)
    rows = []
    for item, flags in zip(sampled, correct, strict=True):
        good = list(dict.fromkeys(r for r, ok in zip(item.responses, flags) if ok))
        bad = list(dict.fromkeys(r for r, ok in zip(item.responses, flags) if not ok))
        if not good and fallback and item.question in fallback:
            good = [fallback[item.question]]
        rng.shuffle(bad)
        for chosen, rejected in list(zip(good * len(bad), bad))[:pairs_per_question]:
            if chosen == rejected:
                continue
            rows.append({"conversations": [{"from": "human", "value": item.question}],
                         "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected},
                         "system": system})
    return rows


def dpo_questions(data: DatasetRef, limit: int | None) -> list[dict[str, Any]]:
    """The questions self-critic DPO samples (id, kind, question, answer): the generated task set's train split, or,
    for real data, the first `limit` rows of the RL train parquet the data stage wrote (validated there)."""
    if "tasks" in data.files:
        return train_tasks(data.file("tasks"))[:limit]
    rows = read_rl_parquet(data.file("rl_train"), limit=limit)
    return [{"id": row.index, "kind": row.ability or "qa", "question": row.question, "answer": row.ground_truth}
            for row in rows]


def ranking_row(path: Path, index: int, raw: Any) -> dict[str, Any]:
    """Validate a sharegpt ranking row (conversations ending with the user; chosen/rejected assistant turns)."""
    from stages.core.rl_parquet import DatasetRowError

    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), dict) for k in ("chosen", "rejected")):
        raise DatasetRowError(path, index, "a preference row needs 'chosen' and 'rejected' {from, value} objects")
    answer = {"from": "gpt", "value": "x"}
    base = sharegpt_row(path, index, {**raw, "conversations": [*raw.get("conversations", []), answer]})
    out = {"conversations": base["conversations"][:-1], "system": base["system"]}
    for side in ("chosen", "rejected"):
        value = raw[side].get("value", raw[side].get("content"))
        if not isinstance(value, str) or not value.strip():
            raise DatasetRowError(path, index, f"'{side}' must hold a non-empty 'value'")
        out[side] = {"from": "gpt", "value": value}
    return out


def dpo_key(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef | None) -> str:
    """The stage's one key (its folder name and its Prefect cache key). Disabled, it names the checkpoint handed
    on unchanged."""
    dpo = cfg.dpo
    if not dpo.enabled:
        return hash_value(dpo.enabled, checkpoint.fingerprint)
    inputs = [hash_input(dpo.dataset_path or "", "sft.dpo.dataset_path")] if dpo.source == "file" \
        else teacher_key_inputs(agent, data)
    shared = {"template", "bf16", "deepspeed", "seed", "teacher_seed", "lr_scheduler_type", "warmup_ratio"}
    return hash_value(dpo, cfg.model_dump(mode="json", include=shared), checkpoint.fingerprint, inputs,
                      code_version(__name__))


def run_dpo(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef | None,
            output_root: str, cache_root: str, force: bool = False) -> CheckpointRef:
    """Self-critic DPO on top of the SFT checkpoint; returns it unchanged when sft.dpo.enabled is false."""
    dpo = cfg.dpo
    if not dpo.enabled:
        return checkpoint
    base = checkpoint.base
    template = checkpoint.meta.get("template") or (template_of(cfg, base) if base else cfg.template)
    if not template:
        raise ValueError("no LLaMA-Factory template for DPO: set sft.template")
    out = stage_dir(output_root, "dpo", dpo_key(cfg, agent, checkpoint, data), force=force)
    model_dir = out.path / "model"
    if not out.complete:
        with tracking.stage_run("dpo", out.path) as run:  # LLaMA-Factory logs the DPO loss into it (report_to)
            metrics = compute_dpo(cfg, agent, checkpoint, data, out, cache_root, template, run.handoff())
            run.log_summary({f"summary/{k}": v for k, v in tracking.numeric(metrics).items()})
    marker = out.marker()
    return CheckpointRef(path=str(model_dir), fingerprint=marker["fingerprint"], format="hf", base=base,
                         meta={"template": template, "metrics": marker.get("metrics", {}), "stage_dir": str(out.path),
                               "after": "dpo"})


def compute_dpo(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef | None,
                out: StageDir, cache_root: str, template: str, report: tracking.Handoff) -> dict[str, Any]:
    """Pairs, LLaMA-Factory DPO (its logger: `report`), the merged HF folder; finishes `out`; returns the metrics."""
    dpo, base = cfg.dpo, checkpoint.base
    model_dir, trainer = out.path / "model", out.path / "trainer"
    preflight(cfg)
    counts = _pairs(cfg, agent, checkpoint, data, out.path / "pairs", cache_root)
    env = subprocess_env()
    if not model_dir.is_dir():
        if not (trainer / "all_results.json").is_file():
            resume = resume_point(trainer)
            args = lf_config.dpo_train_args(dpo, cfg, model_path=local_path(checkpoint.path),
                                            template=template, dataset_dir=str(out.path / "pairs"),
                                            dataset=PAIRS_NAME, output_dir=str(trainer),
                                            resume_from=str(resume) if resume else None,
                                            report_to=report.report_to, run_name=report.name or None)
            train_env = {**env, **report.env}
            cmd = lf_config.train_command(cfg.launcher, cfg.nproc_per_node, str(out.path / "dpo.yaml"),
                                          bin_dir(), train_env)
            run_config(args, out.path / "dpo.yaml", cmd, out.path / "dpo.log", train_env, "dpo")
        merge_lora(local_path(checkpoint.path), str(trainer), template, model_dir, cfg.bf16, out.path, env)
    if base is not None:
        check_hf_folder(model_dir, base)
    metrics = {**{k: v for k, v in training_metrics(trainer).items() if v is not None}, **counts}
    write_json(out.path / "metrics.json", metrics)
    out.finish(content=model_dir, metrics=metrics, template=template)
    return metrics


def _pairs(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef | None, folder: Path,
           cache_root: str) -> dict[str, Any]:
    counts_path = folder / "counts.json"
    if counts_path.is_file():
        return json.loads(counts_path.read_text())
    dpo = cfg.dpo
    if dpo.source == "file":
        rows = [ranking_row(Path(dpo.dataset_path or ""), i, raw) for i, raw in read_records(dpo.dataset_path or "")]
        counts = {"pairs": len(rows)}
    else:
        rows, counts = sampled_pairs(cfg, agent, checkpoint, data, cache_root)
    if not rows:
        raise ValueError(f"self-critic DPO found no (correct, incorrect) pair among {counts}; raise "
                         "sft.dpo.samples_per_question or sft.dpo.max_questions, or set sft.dpo.enabled=false")
    write_lf_dataset(rows, folder, PAIRS_NAME, ranking=True)
    write_json(counts_path, counts)
    return counts


def sampled_pairs(cfg: SFTSection, agent: AgentSection, checkpoint: CheckpointRef, data: DatasetRef | None,
                  cache_root: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from stages.agent.rewards import compute_rewards

    dpo = cfg.dpo
    if data is None:
        raise ValueError("sft.dpo.source=sampled needs the data stage's DatasetRef (its tasks or RL parquet)")
    tasks = dpo_questions(data, dpo.max_questions)
    rollout = sampling_settings(dpo.samples_per_question, dpo.temperature, dpo.max_new_tokens,
                                agent.limits.max_calls, backend=dpo.rollout_backend)
    sampled = sample(checkpoint, tasks, agent, data, cache_root, rollout, seed=cfg.seed)
    correct = []
    for item in sampled:
        rewards = compute_rewards(dpo.reward, list(item.responses), [item.ground_truth] * len(item.responses),
                                  [item.ability] * len(item.responses))
        correct.append([r.correct for r in rewards])
    fallback = None
    if dpo.chosen_fallback == "teacher":
        if "tasks" not in data.files:
            raise BadInputError("sft.dpo.chosen_fallback=teacher needs the generated task set (data.source="
                                "synthetic); with an RL parquet set it to gold or none")
        report = teacher_report(tasks, agent, data, cache_root, len(tasks), cfg.teacher_seed)
        by_id = {t["id"]: t["question"] for t in tasks}
        fallback = {by_id[row["id"]]: row["conversations"][1]["value"] for row in report.rows}
    elif dpo.chosen_fallback == "gold":
        fallback = {t["question"]: minimal_answer(str(t["answer"])) for t in tasks}
    rows = preference_pairs(sampled, correct, system_prompt(agent.prompt_template), dpo.pairs_per_question,
                            fallback, seed=cfg.seed)
    n = sum(len(c) for c in correct)
    counts = {"questions": len(sampled), "samples": n, "correct_samples": sum(sum(c) for c in correct),
              "questions_with_sampled_correct": sum(any(c) for c in correct), "pairs": len(rows)}
    log.info("self-critic DPO pairs: %s", counts)
    return rows, counts
