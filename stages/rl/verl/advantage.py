"""verl's padded batch -> the inputs of `stages.rl.advantages.compute_advantages` (no verl import here).

verl hands an estimator rewards as `token_level_rewards` (the score on the last response token), the GRPO group as
the prompt `uid` per row, and rows in any order (`trainer.balance_batch` reorders them across ranks). The tree's
structure travels per row in `extra_fields` (`arpo_tree_index`, `arpo_parent`, `arpo_fork_at`, written by
`stages.rl.verl.tree.tree_outputs`). Rows are put into (uid, tree index) order so parents precede children, our
registered estimator runs, and the result is put back into verl's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stages.core.config.rl import AdvantageSection
from stages.rl.advantages import compute_advantages, owner_matrix


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


def tree_advantages(cfg: AdvantageSection, token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor,
                    uids: Sequence[Any], extra_fields: Sequence[dict[str, Any]] | None = None,
                    entropy_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Our advantages for verl's rows (returned in verl's row order)."""
    rewards_B = token_rewards_BT.float().sum(dim=-1)
    mask_BT = mask_BT.float()
    if cfg.attribution == "soft" or extra_fields is None:
        if cfg.attribution == "hard":
            raise ValueError("rl.advantage.attribution=hard needs the tree fields (extra_fields); the verl engine "
                             "computes it in trainer.v1.trainer_mode=arpo_sync, which the mapping selects")
        return compute_advantages(cfg, rewards_B, group_ids(uids), mask_BT, None,
                                  entropy_BT.float() if entropy_BT is not None else None)
    order = tree_order(uids, extra_fields)
    idx = torch.tensor(order, dtype=torch.long)
    uids_o, extra_o = [uids[r] for r in order], [extra_fields[r] for r in order]
    owner = tree_owner(uids_o, extra_o, mask_BT.shape[1])
    adv = compute_advantages(cfg, rewards_B[idx], group_ids(uids_o), mask_BT[idx], owner,
                             entropy_BT[idx].float() if entropy_BT is not None else None)
    out = torch.empty_like(adv)
    out[idx] = adv
    return out
