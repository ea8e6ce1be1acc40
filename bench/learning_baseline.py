"""The SFT policy on every RL step's own prompts: is a falling training reward the policy getting worse, or a
harder batch? (bench/bench_learning.py, job `<family>/sftsteps:<seed>`.)

Every algorithm of one seed trains on the same prompts in the same order: a step's prompts and its rollout seed are
pure functions of (seed, step) (stages/rl/trainer.py `step_batch`, `rollout_seed`, which the trainer's own batch
loop calls: this module calls them too, no copy). This job takes, for each step of the run, exactly those prompts
and that rollout seed, and rolls the SFT policy out on them the way
GRPO does (n independent trajectories per prompt, the run's tools and limits), with no update: its reward, accuracy,
format errors and tool calls per step. Step 1 of a GRPO run samples the SFT policy on these same prompts, so its
step-1 row is this row; a later step's RL reward minus this one is what training changed on those prompts.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

STEP_KEYS = ("reward/mean", "accuracy", "reward/format_error_rate", "tools/calls_per_traj", "finish/length",
             "response/length", "reward/groups_without_signal")


def sft_step_rewards(cfg: Any, sft: Any, data: Any, seed: int, out: Path) -> dict[str, Any]:
    """Roll the SFT policy out on each RL step's prompts (rollout seed of that step) and write the rows to `out`."""
    import torch

    from stages.agent.rewards import compute_rewards
    from stages.core.algorithm_spec import SPECS
    from stages.core.atomic import write_json
    from stages.core.env import PROJECT_ROOT
    from stages.core.rl_parquet import read_rl_parquet
    from stages.generation.models import load_policy, load_tokenizer
    from stages.generation.session import RolloutSession
    from stages.rl.rollout import tree_rollouts
    from stages.rl.step_metrics import rollout_metrics
    from stages.rl.trainer import rollout_seed, step_batch, step_counts

    baseline = next(spec.name for spec in SPECS if not spec.branches)  # independent samples, as GRPO draws them
    rows = read_rl_parquet(data.file("rl_train"))
    per_epoch, total = step_counts(len(rows), cfg.rl)
    size = cfg.rl.trainer.train_batch_size
    model = load_policy(sft, torch.float32).eval()
    tokenizer = load_tokenizer(sft)
    session = RolloutSession(cfg.rl.rollout.generation(), cfg.agent, model, tokenizer, data,
                             PROJECT_ROOT / ".cache", seed, make_rollout=tree_rollouts(cfg.rl.rollout, baseline))
    steps = []
    try:
        for step in range(total):
            start = time.perf_counter()
            batch_rows = [rows[i] for i in step_batch(len(rows), seed, step, per_epoch, size)[0]]
            with torch.no_grad():
                batch = session.rollout(batch_rows, seed=rollout_seed(seed, step))
            rewards = compute_rewards(cfg.rl.trainer.reward, [t.response_text for t in batch.trajectories],
                                      [g.ground_truth for g in batch.groups for _ in g.trajectories],
                                      [g.ability for g in batch.groups for _ in g.trajectories])
            metrics = rollout_metrics(batch, rewards)
            values = {k: metrics.get(k, 0.0 if k.startswith("finish/") else None) for k in STEP_KEYS}
            steps.append({"step": step + 1, "questions": [r.question for r in batch_rows], **values,
                          "seconds": time.perf_counter() - start})
            print(f"sft on step {step + 1}'s prompts: reward {metrics['reward/mean']:.3f}", flush=True)
    finally:
        session.close()
    record = {"seed": seed, "policy": sft.path, "n": cfg.rl.rollout.n, "steps": steps}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, record)
    return record


def steps_against_sft(by_algo: dict[str, list[dict[str, Any]]], baselines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step, mean over the seeds that have both: the SFT policy's reward (and format errors) on that step's
    prompts, and each algorithm's. A step where every policy, SFT included, scores low is a hard batch."""
    base = {(b["seed"], s["step"]): s for b in baselines for s in b["steps"]}
    algos = list(by_algo)
    columns = ["step", "SFT reward", *[f"{a} reward" for a in algos], "SFT format err",
               *[f"{a} format err" for a in algos]]
    rows = []
    for step in sorted({step for _, step in base}):
        seeds = [seed for seed, s in base if s == step]
        row: list[Any] = [step, _seed_mean([base[(seed, step)]["reward/mean"] for seed in seeds])]
        for key in ("reward/mean", "reward/format_error_rate"):
            if key != "reward/mean":
                row.append(_seed_mean([base[(seed, step)][key] for seed in seeds]))
            for algo in algos:
                row.append(_seed_mean([x[key] for r in by_algo[algo] if r["seed"] in seeds
                                       for x in r["steps"] if x["step"] == step and x.get(key) is not None]))
        rows.append(row)
    return {"columns": columns, "rows": rows}


def _seed_mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None
