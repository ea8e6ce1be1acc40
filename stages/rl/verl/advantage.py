"""verl's padded batch -> the inputs of `stages.rl.advantages.compute_advantages` (no verl import here).

verl hands an estimator rewards as `token_level_rewards` (the score on the last response token), the GRPO group as
the prompt `uid` per row, and rows in any order (`trainer.balance_batch` reorders them across ranks). The tree's
structure travels per row in `extra_fields` (`arpo_tree_index`, `arpo_parent`, `arpo_fork_at`, written by
`stages.rl.verl.tree.tree_outputs`). Rows are put into (uid, tree index) order so parents precede children, our
registered estimator runs, and the result is put back into verl's order.

Only whole trees reach the estimator: `whole_trees` checks that every prompt has exactly n trajectories with tree
indices 0..n-1 (a failed tree is removed by our agent-loop worker; padding rows that verl appends to make the
batch divisible are left out and get advantage 0).

Trajectories touched by a tool infrastructure failure come with an all-zero response mask (`tree_outputs`; so
verl's loss leaves them out) and `arpo_masked` in extra_fields; they are kept out of their group's statistics
here (`compute_advantages(keep_B=...)`, as in the local engine). verl's plain estimator call passes no
extra_fields, so there a row without loss tokens is the sign. When their share reaches `rl.alarms.infra_share`
the `infra_failures` alarm is logged, and raised (stopping verl) when it is in `rl.alarms.stop_on`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stages.core.config.rl import AdvantageSection, AlarmSection
from stages.core.log import get_logger
from stages.rl.advantages import compute_advantages, owner_matrix
from stages.rl.alarms import AlarmStop, infra_failures

log = get_logger(__name__)


class PartialTreeError(RuntimeError):
    """A prompt's rows are not one whole tree (GRPO statistics and attribution would be wrong)."""


def group_ids(uids: Sequence[Any]) -> torch.Tensor:
    """An integer group per row, equal for equal uids (first-seen order)."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(str(u), len(seen)) for u in uids], dtype=torch.long)


def tree_order(uids: Sequence[Any], extra_fields: Sequence[dict[str, Any]]) -> list[int]:
    """Row indices sorted by (group, tree index): every parent comes before its children."""
    group = group_ids(uids).tolist()
    return sorted(range(len(uids)), key=lambda r: (group[r], int(extra_fields[r].get("arpo_tree_index", 0))))


def tree_owner(uids: Sequence[Any], extra_fields: Sequence[dict[str, Any]], width: int) -> torch.Tensor:
    """owner_BT over rows already in tree order (see stages.rl.advantages.owner_matrix)."""
    row_of = {(str(u), int(e.get("arpo_tree_index", -1))): r for r, (u, e) in enumerate(zip(uids, extra_fields))}
    parents, forks = [], []
    for u, e in zip(uids, extra_fields):
        parent = row_of.get((str(u), int(e.get("arpo_parent", -1)))) if int(e.get("arpo_parent", -1)) >= 0 else None
        parents.append(parent)
        forks.append(int(e.get("arpo_fork_at", 0)) if parent is not None else 0)
    return owner_matrix(parents, forks, width)


def kept_rows(mask_BT: torch.Tensor, extra_fields: Sequence[dict[str, Any]] | None) -> torch.Tensor:
    """Rows to train on: not flagged `arpo_masked` (a tool infrastructure failure) and with loss tokens."""
    keep_B = mask_BT.sum(dim=-1) > 0
    if extra_fields is not None:
        keep_B &= torch.tensor([not e.get("arpo_masked") for e in extra_fields], dtype=torch.bool)
    return keep_B


def check_infra_share(keep_B: torch.Tensor, rules: AlarmSection | None) -> str | None:
    """The infra_failures alarm over this step's rows (logged; AlarmStop when it is in rules.stop_on)."""
    if rules is None or not rules.enabled or keep_B.numel() == 0:
        return None
    total, masked = keep_B.numel(), int((~keep_B).sum())
    message = infra_failures([{"rollout/masked_share": masked / total, "rollout/masked_trajectories": masked,
                               "rollout/trajectories": total}], rules)
    if message is not None:
        log.warning("alarm infra_failures: %s", message)
        if "infra_failures" in rules.stop_on:
            raise AlarmStop(f"RL stopped: alarm infra_failures ({message}); it is in rl.alarms.stop_on. Fix the "
                            "search provider / sandbox or remove it from stop_on; a rerun resumes from the last "
                            "checkpoint")
    return message


def tree_advantages(cfg: AdvantageSection, token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor,
                    uids: Sequence[Any], extra_fields: Sequence[dict[str, Any]] | None = None,
                    entropy_BT: torch.Tensor | None = None, alarms: AlarmSection | None = None) -> torch.Tensor:
    """Our advantages for verl's rows (returned in verl's row order); `alarms` checks the infra_failures share."""
    rewards_B = token_rewards_BT.float().sum(dim=-1)
    mask_BT = mask_BT.float()
    keep_B = kept_rows(mask_BT, extra_fields)
    check_infra_share(keep_B, alarms)
    if cfg.attribution == "soft" or extra_fields is None:
        if cfg.attribution == "hard":
            raise ValueError("rl.advantage.attribution=hard needs the tree fields (extra_fields); the verl engine "
                             "computes it in trainer.v1.trainer_mode=arpo_sync, which the mapping selects")
        return compute_advantages(cfg, rewards_B, group_ids(uids), mask_BT, None,
                                  entropy_BT.float() if entropy_BT is not None else None, keep_B)
    order = tree_order(uids, extra_fields)
    idx = torch.tensor(order, dtype=torch.long)
    uids_o, extra_o = [uids[r] for r in order], [extra_fields[r] for r in order]
    owner = tree_owner(uids_o, extra_o, mask_BT.shape[1])
    adv = compute_advantages(cfg, rewards_B[idx], group_ids(uids_o), mask_BT[idx], owner,
                             entropy_BT[idx].float() if entropy_BT is not None else None, keep_B[idx])
    out = torch.empty_like(adv)
    out[idx] = adv
    return out


def whole_trees(uids: Sequence[Any], extra_fields: Sequence[dict[str, Any]], n: int) -> int:
    """The number of trees in the rows; raises PartialTreeError unless each uid has exactly the tree indices
    0..n-1 (one row each)."""
    indices: dict[str, list[int]] = {}
    for u, e in zip(uids, extra_fields):
        indices.setdefault(str(u), []).append(int(e.get("arpo_tree_index", -1)))
    for uid, got in indices.items():
        if sorted(got) != list(range(n)):
            raise PartialTreeError(f"prompt {uid} reached the advantage with tree indices {sorted(got)} instead of "
                                   f"0..{n - 1}: a partial tree (stages.rl.verl.agent_loop removes failed trees; "
                                   "rl.rollout.n and actor_rollout_ref.rollout.n must agree)")
    return len(indices)


def step_advantages(cfg: AdvantageSection, token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor,
                    uids: Sequence[Any], extra_fields: Sequence[dict[str, Any]], padding: Sequence[bool], n: int,
                    entropy_BT: torch.Tensor | None = None,
                    alarms: AlarmSection | None = None) -> tuple[torch.Tensor, int]:
    """Advantages of one verl step (rows in verl's order): whole trees only, padding rows 0; `alarms` checks the
    infra_failures share of the real rows. Returns (advantages_BT, number of trees)."""
    real = [r for r, pad in enumerate(padding) if not pad]
    trees = whole_trees([uids[r] for r in real], [extra_fields[r] for r in real], n)
    adv = torch.zeros_like(mask_BT, dtype=torch.float32)
    if real:
        idx = torch.tensor(real, dtype=torch.long)
        adv[idx] = tree_advantages(cfg, token_rewards_BT[idx], mask_BT[idx], [uids[r] for r in real],
                                   [extra_fields[r] for r in real],
                                   entropy_BT[idx] if entropy_BT is not None else None, alarms)
    return adv, trees


def tree_metrics(trees: int, expected: int, infra: int = 0) -> dict[str, float]:
    """`rollout/trees_trained`, and `rollout/trees_dropped`: prompts of the step whose tree failed (removed whole by
    the agent-loop worker; verl's sync sampler still counts them in the batch, so they are missing rows), split
    into `rollout/trees_dropped_infra` (`infra` of them failed on the environment: stages/rl/verl/failures.py) and
    `rollout/trees_dropped_other`."""
    dropped = max(0, expected - trees)
    by_infra = min(max(0, infra), dropped)
    return {"rollout/trees_trained": float(trees), "rollout/trees_dropped": float(dropped),
            "rollout/trees_dropped_infra": float(by_infra), "rollout/trees_dropped_other": float(dropped - by_infra)}
