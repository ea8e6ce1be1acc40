"""verl's per-step metrics in our monitoring: metrics.jsonl, the live progress line, rl-curves and the RL alarms
(no verl import; the mapping is documented in docs/rl.md "verl's metrics").

Two sources make one row per step:
- our trainer mode (`arpo_sync`, stages/rl/verl/trainer_mode.py) computes the local engine's rollout metrics from
  the step's TransferQueue rows (`rollout_metrics`: rewards, accuracy, tools, branches, finish reasons, lengths,
  entropy / ln|V|) and logs them through verl's logger under `arpo/<our name>`;
- verl's own metrics (loss, gradient norm, clipping, timings), renamed by `VERL_NAMES`; every other verl metric is
  kept as `verl/<its name>`. The rollout-vs-trainer gap the drift alarm reads, `rollout/logp_mismatch`, is ours
  (`logp_mismatch`: mean |log p| difference per token, as the local engine measures it); verl's
  `training/rollout_probs_diff_mean` is a mean *probability* difference and is kept as `rollout/prob_mismatch`.
The launcher follows verl's file logger (one JSON line per step) while verl runs (`Follower`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

OURS = "arpo/"
VERL_NAMES = {
    "actor/pg_loss": "loss", "actor/grad_norm": "grad_norm", "actor/pg_clipfrac": "clip_fraction",
    "actor/pg_clipfrac_lower": "dual_clip_fraction", "actor/ppo_kl": "ppo_kl", "actor/kl_loss": "kl/ref",
    "actor/lr": "lr", "training/rollout_probs_diff_mean": "rollout/prob_mismatch",
    "timing_s/gen": "timing/rollout_s", "timing_s/old_log_prob": "timing/old_logprob_s",
    "timing_s/adv": "timing/advantage_s", "timing_s/update_actor": "timing/update_s",
    "timing_s/save_checkpoint": "timing/checkpoint_s", "timing_s/update_weights": "timing/weight_sync_s",
    "timing_s/step": "timing/step_s", "training/epoch": "epoch",
}

# tree_outputs' per-tree fields -> the local engine's names (stages.rl.step_metrics.step_time_split)
TIME_FIELDS = {"arpo_time_generate_s": "timing/generate_s", "arpo_time_tools_s": "timing/tools_s",
               "arpo_time_tool_queue_s": "timing/tool_queue_s", "arpo_calls_per_round": "tools/calls_per_round",
               "arpo_tools_offered": "tools/offered"}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def rollout_metrics(uids: Sequence[Any], extras: Sequence[dict[str, Any]], scores_B: torch.Tensor,
                    mask_BT: torch.Tensor, lengths_B: torch.Tensor, entropy_BT: torch.Tensor | None,
                    vocab_size: int) -> dict[str, float]:
    """The local engine's rollout metrics (stages.rl.step_metrics.rollout_metrics) over one verl step's real rows.

    `extras` are the rows' extra_fields (our tree fields + verl's `reward_extra_info` from our reward), `mask_BT`
    the response mask (1 = model token) padded to a common width, `lengths_B` the response lengths."""
    n = len(uids)
    if n == 0:
        return {}
    scores = [float(s) for s in scores_B.tolist()]
    info = [dict(e.get("reward_extra_info") or {}) for e in extras]
    groups: dict[str, list[float]] = {}
    first: dict[str, dict[str, Any]] = {}
    for u, e, s in zip(uids, extras, scores):
        groups.setdefault(str(u), []).append(s)
        first.setdefault(str(u), e)
    model_tokens = mask_BT.float().sum(-1)
    finish = Counter(str(e.get("arpo_finish") or "unknown") for e in extras)
    row = {
        "reward/mean": _mean(scores), "reward/std": float(torch.tensor(scores).std()) if n > 1 else 0.0,
        "reward/min": min(scores), "reward/max": max(scores),
        "reward/format_error_rate": _mean([float(i.get("format_error", 0.0)) for i in info]),
        "reward/groups_without_signal": _mean([float(max(g) == min(g)) for g in groups.values()]),
        "accuracy": _mean([float(i.get("acc", 0.0)) for i in info]),
        "f1": _mean([float(i.get("f1", 0.0)) for i in info]),
        "tools/calls_per_traj": _mean([float(e.get("arpo_tool_calls", 0)) for e in extras]),
        "tools/errors_per_traj": _mean([float(e.get("arpo_tool_errors", 0)) for e in extras]),
        # tool infrastructure failures (each counted once: a branch carries only its own) and the trajectories they
        # kept out of the loss, for the infra_failures alarm
        "tools/infra_failures": float(sum(int(e.get("arpo_infra_failures") or 0) for e in extras)),
        "rollout/masked_share": _mean([float(bool(e.get("arpo_masked"))) for e in extras]),
        "rollout/masked_trajectories": float(sum(bool(e.get("arpo_masked")) for e in extras)),
        "rollout/trajectories": float(n),
        "rollout/branches_per_group": _mean([float(e.get("arpo_branches", 0)) for e in first.values()]),
        "rollout/fresh_per_group": _mean([float(e.get("arpo_fresh", 0)) for e in first.values()]),
        "response/length": float(lengths_B.float().mean()),
        "response/model_tokens": float(model_tokens.mean()),
        "response/tool_tokens": float((lengths_B.float() - model_tokens).mean()),
    }
    # where the trees' time went (each tree's own split, from tree_outputs): the mean over the step's trees
    for field, name in TIME_FIELDS.items():
        values = [float(e[field]) for e in first.values() if isinstance(e.get(field), (int, float))]
        if values:
            row[name] = _mean(values)
    # calls per tool (the local engine's tools/<tool>_per_traj and tools/used_both_rate: stages/rl/step_metrics.py)
    by_tool = [json.loads(e.get("arpo_calls_by_tool") or "{}") for e in extras]
    for tool in sorted({k for calls in by_tool for k in calls}):
        row[f"tools/{tool}_per_traj"] = _mean([float(calls.get(tool, 0)) for calls in by_tool])
    row["tools/used_both_rate"] = _mean([float(calls.get("search", 0) > 0 and calls.get("python", 0) > 0)
                                        for calls in by_tool])
    row |= {f"finish/{reason}": count / n for reason, count in sorted(finish.items())}
    if entropy_BT is not None:
        mask = mask_BT.float()
        row["entropy/mean"] = float((entropy_BT.float() * mask).sum() / mask.sum().clamp(min=1)) / math.log(vocab_size)
    return row


def logp_mismatch(rollout_logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                  forced_B: Sequence[int | None] = ()) -> float:
    """Mean over response tokens of |log p_rollout - log p_trainer| (the sampler-vs-policy gap of the local engine's
    `rollout/logp_mismatch`): verl's vLLM log-probs of the tokens it sampled vs the actor's old-log-prob pass. A row's
    `forced_B` position (the EOS our tree loop appends after a refused call: no sampling log-prob) is left out."""
    mask = mask_BT.float().clone()
    for b, at in enumerate(forced_B):
        if at is not None and at < mask.shape[1]:
            mask[b, at] = 0
    return float(((rollout_logp_BT.float() - old_logp_BT.float()).abs() * mask).sum() / mask.sum().clamp(min=1))


def our_row(step: int, logged: dict[str, Any]) -> dict[str, Any]:
    """One metrics.jsonl row from the metrics verl logged for `step` (see the module docstring)."""
    row: dict[str, Any] = {"step": step}
    for key, value in logged.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key.startswith(OURS):
            row[key[len(OURS):]] = float(value)
        elif key in VERL_NAMES:
            row[VERL_NAMES[key]] = float(value)
        else:
            row[f"verl/{key}"] = float(value)
    return row


def read_steps(attempts: Sequence[Path]) -> dict[int, dict[str, Any]]:
    """verl's file-logger rows of every attempt -> our row per step (a resumed step keeps the last attempt's)."""
    rows: dict[int, dict[str, Any]] = {}
    for attempt in attempts:
        if not attempt.is_file():
            continue
        for line in attempt.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                rows[int(record["step"])] = our_row(int(record["step"]), record.get("data", {}))
    return rows


class Follower:
    """Reads verl's file logger while verl runs and hands each new step's row to `on_step` (once per step)."""

    def __init__(self, attempts: Callable[[], Sequence[Path]], on_step: Callable[[dict[str, Any]], None]) -> None:
        self.attempts, self.on_step = attempts, on_step
        self.seen: dict[int, dict[str, Any]] = {}

    def poll(self) -> list[dict[str, Any]]:
        try:
            rows = read_steps(self.attempts())
        except json.JSONDecodeError:  # a line being written: the next poll reads it whole
            return []
        new = [rows[s] for s in sorted(rows) if s not in self.seen]
        for row in new:
            self.seen[row["step"]] = row
            self.on_step(row)
        return new


class LiveReport:
    """What the local trainer reports per step, for verl's steps: metrics.jsonl (one row per step, all attempts),
    the progress line, the rl-curves and rl-rollouts artifacts (every rl.trainer.report_every steps; the rollouts
    from our trainer mode's `rollouts/step_<k>.jsonl`) and the RL alarms."""

    def __init__(self, cfg: Any, stage: Path, tracker: Any, resumed_step: int) -> None:
        from stages.rl.alarms import AlarmWatch

        self.cfg, self.stage, self.tracker = cfg, Path(stage), tracker
        self.watch = AlarmWatch(cfg.alarms, self.stage / "alarms.jsonl", resumed_step=resumed_step)
        self.history: list[dict[str, Any]] = []

    def on_step(self, row: dict[str, Any]) -> None:
        from stages.core.atomic import write_jsonl
        from stages.core.tracking import log_step
        from stages.rl.alarms import AlarmStop
        from stages.rl.publish import publish_results
        from stages.rl.step_metrics import step_note

        self.history = sorted([r for r in self.history if r["step"] != row["step"]] + [row], key=lambda r: r["step"])
        try:
            self.watch.check([r for r in self.history if r["step"] <= row["step"]])
        except AlarmStop as stop:
            raise AlarmStop(f"{stop} (verl saves a step's checkpoint before it logs the step, so "
                            f"checkpoints/global_step_{row['step']} may exist: delete it to redo the step)") from None
        finally:
            write_jsonl(self.stage / "metrics.jsonl", self.history)
            log_step(row)  # the stage's tracker run (stages.core.tracking): the local engine's names
        self.tracker.update(row["step"], note=step_note(row))
        if row["step"] % self.cfg.trainer.report_every == 0:  # rl-curves, and rl-rollouts from our step dumps
            publish_results(self.cfg, self.stage, self.history)


def dump_row(step: int, uid: str, extra: dict[str, Any], sample: dict[str, Any], response: str, score: float,
             adv_T: torch.Tensor, mask_T: torch.Tensor) -> dict[str, Any]:
    """One trajectory of a verl step in the local engine's rollout-dump format (stages.rl.step_metrics.dump_rollouts),
    plus what shows the tree was trained whole and tool tokens were masked: the advantage on tool tokens."""
    info = dict(extra.get("reward_extra_info") or {})
    reason = "format error" if info.get("format_error") else ("correct" if info.get("acc") else "answered")
    model = mask_T.float()
    return {"step": step, "group": uid, "traj_id": int(extra.get("arpo_tree_index", -1)),
            "kind": extra.get("arpo_kind"), "parent_id": int(extra.get("arpo_parent", -1)),
            "fork_at": int(extra.get("arpo_fork_at", 0)),
            "question": (sample.get("extra_info") or {}).get("question"), "ability": extra.get("ability"),
            "ground_truth": (sample.get("reward_model") or {}).get("ground_truth"), "prompt": None,
            "response": response, "reward": {"score": score, "reason": reason, **info},
            "advantage": float((adv_T * model).sum() / model.sum().clamp(min=1)),
            "advantage_on_tool_tokens": float((adv_T.abs() * (1 - model)).max()) if len(model) else 0.0,
            "tool_calls": {"all": int(extra.get("arpo_tool_calls", 0))},
            "tool_errors": int(extra.get("arpo_tool_errors", 0)), "finish_reason": extra.get("arpo_finish"),
            "length": int(len(mask_T)), "model_tokens": int(model.sum())}
