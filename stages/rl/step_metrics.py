"""Per-step metrics, rollout dumps and training curves (collapse alarms: stages/rl/alarms.py).

metrics.jsonl holds exactly one row per completed step. A step is complete when its checkpoint is written (the
row is also stored inside the checkpoint), so after a crash `reconcile_metrics` rewrites the file to the rows of
steps <= the resumed checkpoint and puts back a row the crash kept from being appended.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from stages.agent.rewards import Reward
from stages.core.atomic import read_jsonl, save_figure, write_jsonl
from stages.core.log import get_logger
from stages.generation.types import RolloutBatch
from stages.rl.tree_record import trajectory_tree_fields

log = get_logger(__name__)


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def rollout_metrics(batch: RolloutBatch, rewards: list[Reward]) -> dict[str, float]:
    """Reward, accuracy, tool use, branching and length statistics of one step's rollouts."""
    trajs = batch.trajectories
    scores = torch.tensor([r.score for r in rewards], dtype=torch.float64)
    calls = [sum(t.tool_calls.values()) for t in trajs]
    finish = Counter(t.finish_reason or "unknown" for t in trajs)
    # exact equality, not std == 0: a float std of 12 x 0.1 is 1e-17, not 0 (the advantages are exactly 0 there)
    flat = [float(max(r) == min(r)) for r in ([rewards[i].score for i in idx] for idx in _group_rows(batch)) if r]
    row = {
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(trajs) > 1 else 0.0,
        "reward/min": float(scores.min()), "reward/max": float(scores.max()),
        "reward/format_error_rate": _mean([float(r.score == -1.0 and r.answer is None) for r in rewards]),
        "reward/groups_without_signal": _mean(flat),
        "accuracy": _mean([float(r.correct) for r in rewards]),
        "f1": _mean([r.f1 for r in rewards]),
        "tools/calls_per_traj": _mean(calls),
        "tools/errors_per_traj": _mean([float(t.tool_errors) for t in trajs]),
        "tools/used_both_rate": _mean([float(t.tool_calls.get("search", 0) > 0 and t.tool_calls.get("python", 0) > 0)
                                       for t in trajs]),
        # the environment's failures (provider, server, sandbox), each counted once; the trajectories they touched
        # are out of the loss (stages/rl/update.py) and counted as rollout/masked_trajectories
        "tools/infra_failures": float(batch.metrics.get("infra_failures", 0.0)),
        "rollout/masked_share": _mean([float(t.masked) for t in trajs]),
        "rollout/trajectories": float(len(trajs)),
        "rollout/initial_per_group": _mean([float(g.initial_rollouts) for g in batch.groups]),
        "rollout/branches_per_group": _mean([float(g.branches) for g in batch.groups]),
        "rollout/fresh_per_group": _mean([float(g.fresh) for g in batch.groups]),
        "response/length": _mean([float(len(t)) for t in trajs]),
        "response/model_tokens": _mean([float(sum(t.loss_mask)) for t in trajs]),
        "response/tool_tokens": _mean([float(len(t) - sum(t.loss_mask)) for t in trajs]),
    }
    row |= step_time_split(batch.metrics)
    for tool in sorted({k for t in trajs for k in t.tool_calls}):
        row[f"tools/{tool}_per_traj"] = _mean([float(t.tool_calls.get(tool, 0)) for t in trajs])
    for reason, count in sorted(finish.items()):
        row[f"finish/{reason}"] = count / len(trajs)
    for key, value in batch.metrics.items():
        if isinstance(value, (int, float)):
            row[f"rollout/{key}"] = float(value)
    return row


def step_time_split(metrics: dict[str, Any]) -> dict[str, float]:
    """Where a rollout's time went (stages.generation.tool_rollout): generate, tools, the tools' queueing (per
    round the longest wait of a call for a pool thread or a rate-limit slot, summed) and tool calls per round;
    `tools/offered`: the tools the prompt offers (the tool_unused alarm at the first step)."""
    names = {"time_generate_s": "timing/generate_s", "time_tools_s": "timing/tools_s",
             "time_tool_queue_s": "timing/tool_queue_s", "tool_calls_per_round": "tools/calls_per_round",
             "tools_offered": "tools/offered"}
    return {ours: float(metrics[key]) for key, ours in names.items() if isinstance(metrics.get(key), (int, float))}


def step_note(row: dict[str, Any]) -> str:
    """The step's progress line: reward, tool use, and where the rollout's time went."""
    nan = float("nan")
    note = f"reward {row.get('reward/mean', nan):.3f}, tools/traj {row.get('tools/calls_per_traj', nan):.2f}"
    if "timing/generate_s" in row:
        note += (f", generate {row['timing/generate_s']:.1f}s, tools {row.get('timing/tools_s', 0.0):.1f}s "
                 f"(queued {row.get('timing/tool_queue_s', 0.0):.1f}s, {row.get('tools/calls_per_round', 0.0):.1f} "
                 "calls/round)")
    return note


def _group_rows(batch: RolloutBatch) -> list[list[int]]:
    rows, start = [], 0
    for group in batch.groups:
        rows.append(list(range(start, start + len(group.trajectories))))
        start += len(group.trajectories)
    return rows


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()


def reconcile_metrics(path: Path, resumed_step: int, checkpoint_row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Make metrics.jsonl hold one row per step 1..resumed_step (dropping rows of steps that will be redone and
    restoring the checkpoint's own row if the crash came before it was appended). Returns the rows."""
    rows = read_jsonl(path) if path.is_file() else []
    by_step = {int(r["step"]): r for r in rows if int(r["step"]) <= resumed_step}
    if checkpoint_row and resumed_step not in by_step:
        by_step[resumed_step] = checkpoint_row
    kept = [by_step[s] for s in sorted(by_step)]
    write_jsonl(path, kept)
    return kept


def dump_rollouts(path: Path, step: int, batch: RolloutBatch, rewards: list[Reward], tokenizer: Any,
                  advantages: list[float]) -> None:
    """One JSON line per trajectory: prompt text, response text, reward, advantage, tools, branch structure and
    the tree's decisions and retrained tokens (stages/rl/tree_record.py)."""
    rows, i = [], 0
    for group in batch.groups:
        prompt_text = tokenizer.decode(group.trajectories[0].prompt_ids, skip_special_tokens=False) \
            if group.trajectories else ""
        for traj in group.trajectories:
            rows.append({"step": step, "group": group.group, "traj_id": traj.traj_id, "kind": traj.kind,
                         "parent_id": traj.parent_id, "fork_at": traj.fork_at, "question": group.question,
                         "ground_truth": group.ground_truth, "prompt": prompt_text if traj is
                         group.trajectories[0] else None, "response": traj.response_text,
                         "reward": rewards[i].to_json(), "advantage": advantages[i],
                         "tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors,
                         "infra_failures": traj.infra_failures, "masked": traj.masked,
                         "finish_reason": traj.finish_reason, "length": len(traj),
                         "model_tokens": int(sum(traj.loss_mask)),
                         **trajectory_tree_fields(traj, group, tokenizer)})  # the tree's decisions (tree_record.py)
            i += 1
    write_jsonl(path, rows)


@functools.cache
def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("matplotlib is not installed in %s: no curves.png (metrics.jsonl has the numbers)", sys.executable)
        return False
    return True


CURVES = (("reward/mean", "reward"), ("accuracy", "accuracy"), ("entropy/mean", "token entropy / ln|V|"),
          ("tools/calls_per_traj", "tool calls per trajectory"))


def plot_curves(rows: list[dict[str, Any]], png: Path) -> Path | None:
    """Reward, accuracy, entropy and tool-call curves over steps, one panel each. None without matplotlib (an
    interpreter that has only what RL needs, e.g. the vLLM environment: metrics.jsonl holds the same numbers)."""
    if not _has_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes, CURVES):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, png)


def rollout_sample_markdown(rollouts_dir: Path, max_trajectories: int = 4, max_chars: int = 1500) -> str:
    """A markdown sample of the newest rollout dump: question, reward, tools and the (clipped) response."""
    dumps = sorted(Path(rollouts_dir).glob("step_*.jsonl"))
    if not dumps:
        return "_no rollout dumps (rl.trainer.dump_rollouts is off or no step ran)_"
    rows = read_jsonl(dumps[-1])[:max_trajectories]
    parts = [f"### Rollouts of step {rows[0]['step'] if rows else '?'} ({dumps[-1].name})"]
    for r in rows:
        response = r["response"] if len(r["response"]) <= max_chars else r["response"][:max_chars] + " [...]"
        parts.append(f"**group {r['group']} / traj {r['traj_id']}** ({r['kind']}, parent {r['parent_id']}, fork at "
                     f"{r['fork_at']}) reward {r['reward']['score']:.3f} ({r['reward']['reason']}), advantage "
                     f"{r['advantage']:.3f}, tools {r['tool_calls']}, finish {r['finish_reason']}\n\n"
                     f"Q: {r['question']}  \ngold: `{r['ground_truth']}`\n\n```text\n{response}\n```")
    return "\n\n".join(parts)
