"""Advantage estimators: one registry, one signature, pure functions over tensors.

Every estimator is called as

    fn(rewards_B, group_B, mask_BT, owner_BT, entropy_BT, cfg) -> adv_BT

rewards_B   float  scalar reward per trajectory
group_B     long   GRPO group (prompt index) per trajectory
mask_BT     float  1 on tokens the policy sampled (loss mask), 0 on tool results and padding
owner_BT    long   row index of the trajectory that first generated token t of row b (see `owner_matrix`),
                   or None when no branch structure is known (needed only for `attribution: hard`)
entropy_BT  float  token entropy of the policy (any positive scale; it is standardised), or None
                   (needed only for `entropy_aware: true`)
cfg         AdvantageSection

The result is zero wherever mask_BT is zero.

Trajectories touched by an infrastructure failure (a provider, server or sandbox failed a tool call) are left out
by the one call site, `compute_advantages(..., keep_B=...)`: their rows get mask 0 and a group of their own, so
every estimator sees them as tokenless singletons: advantage 0, absent from their group's mean and std, from the
hard-attribution means of shared prefixes and from the entropy standardisation (`exclude_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from stages.core.config.rl import AdvantageSection
from stages.core.registry import Registry

AdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                        AdvantageSection], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def group_normalized(rewards_B: torch.Tensor, group_B: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased as torch.std; float32 result.

    The statistics are computed in float64 on rewards shifted by their group's minimum (the shifted-data
    algorithm): a group whose rewards are all equal has deviations of exactly 0, hence mean = its reward and
    std = 0 exactly, and A = 0 exactly for any group size. (Unshifted float32 statistics leave the mean one ulp
    off for e.g. 16 x 1.1 or 12 x 0.1, and (R - mean)/(tiny std + eps) then turns rounding noise into
    advantages of about +-0.1.)

    A group of one trajectory gets A = 0: its mean is its own reward, so R - mean = 0, and the undefined
    unbiased std of one sample (torch.std gives NaN) is taken as 0. (verl instead uses mean 0, std 1 there,
    which turns a lone reward into an advantage; we give no signal without a comparison.)
    """
    rewards_B = rewards_B.detach().to(torch.float64)
    _, inverse_B, counts_G = torch.unique(group_B, return_inverse=True, return_counts=True)
    n_groups = counts_G.numel()
    counts_G = counts_G.to(torch.float64)
    zeros_G = torch.zeros(n_groups, dtype=torch.float64, device=rewards_B.device)
    shift_G = zeros_G.clone().scatter_reduce_(0, inverse_B, rewards_B, reduce="amin", include_self=False)
    shifted_B = rewards_B - shift_G[inverse_B]  # x - x == 0 exactly: all-equal groups have zero deviations
    mean_G = zeros_G.clone().index_add_(0, inverse_B, shifted_B) / counts_G
    centered_B = shifted_B - mean_G[inverse_B]
    sq_G = zeros_G.clone().index_add_(0, inverse_B, centered_B ** 2)
    var_G = torch.where(counts_G > 1, sq_G / (counts_G - 1).clamp(min=1), torch.zeros_like(sq_G))
    std_G = var_G.sqrt()
    return (centered_B / (std_G[inverse_B] + eps)).to(torch.float32)


def owner_matrix(parent_B: Sequence[int | None], fork_at_B: Sequence[int], length: int) -> torch.Tensor:
    """owner[i, t] = owner[parent(i), t] if t < fork_at(i) else i (rows are batch indices).

    A branch copies its parent's first `fork_at` response tokens, so those positions are the same tokens as
    the parent's (and, recursively, as whoever the parent copied them from). Parents must come before their
    children in the batch (creation order); a parent not in the batch makes the row its own owner.
    """
    rows = len(parent_B)
    if len(fork_at_B) != rows:
        raise ValueError(f"owner_matrix: {rows} parents but {len(fork_at_B)} fork points; pass one per row")
    owner_BT = torch.arange(rows).unsqueeze(1).expand(rows, length).clone()
    positions_T = torch.arange(length)
    for i, (parent, fork_at) in enumerate(zip(parent_B, fork_at_B)):
        if parent is None:
            continue
        if not 0 <= parent < i:
            raise ValueError(f"owner_matrix: row {i} has parent row {parent}; a parent must be an earlier row "
                             "of the same batch (keep trajectories in creation order)")
        shared_T = positions_T < fork_at
        owner_BT[i] = torch.where(shared_T, owner_BT[parent], owner_BT[i])
    return owner_BT


def hard_attribution(adv_B: torch.Tensor, owner_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Token (b, t) gets the mean advantage of every trajectory whose token t is the same token, i.e. every row
    j with owner[j, t] == owner[b, t] (and mask[j, t] != 0). After its fork point a row owns its tokens alone
    and keeps its own advantage. Vectorised with one scatter over (owner, position) keys."""
    rows, length = owner_BT.shape
    valid_BT = mask_BT != 0
    key_BT = owner_BT * length + torch.arange(length).unsqueeze(0)
    value_BT = adv_B.to(torch.float32).unsqueeze(1).expand(rows, length) * valid_BT
    sums = torch.zeros(rows * length).index_add_(0, key_BT.reshape(-1), value_BT.reshape(-1))
    counts = torch.zeros(rows * length).index_add_(0, key_BT.reshape(-1), valid_BT.reshape(-1).to(torch.float32))
    mean_BT = (sums / counts.clamp(min=1))[key_BT]
    return torch.where(valid_BT, mean_BT, torch.zeros_like(mean_BT))


def entropy_scaling(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, alpha: float) -> torch.Tensor:
    """AEPO: factor 1 + alpha * sg(H_std), H standardised over the valid tokens (std unbiased; 1 if it is 0)."""
    valid_BT = mask_BT != 0
    entropy_BT = entropy_BT.detach().to(torch.float32)
    values = entropy_BT[valid_BT]
    if values.numel() == 0:
        return torch.ones_like(entropy_BT)
    mean = values.mean()
    std = values.std() if values.numel() > 1 else torch.tensor(0.0)
    if not torch.isfinite(std) or std == 0:
        std = torch.tensor(1.0)
    standardized_BT = (entropy_BT - mean) / std
    return torch.where(valid_BT, 1.0 + alpha * standardized_BT, torch.ones_like(entropy_BT))


def check_inputs(rewards_B: torch.Tensor, group_B: torch.Tensor, mask_BT: torch.Tensor,
                 owner_BT: torch.Tensor | None, entropy_BT: torch.Tensor | None) -> None:
    rows = rewards_B.shape[0]
    if rewards_B.dim() != 1 or group_B.shape != (rows,) or mask_BT.dim() != 2 or mask_BT.shape[0] != rows:
        raise ValueError(f"advantage inputs must be rewards_B {tuple(rewards_B.shape)}, group_B "
                         f"{tuple(group_B.shape)}, mask_BT {tuple(mask_BT.shape)} with the same B")
    for name, tensor in (("owner_BT", owner_BT), ("entropy_BT", entropy_BT)):
        if tensor is not None and tensor.shape != mask_BT.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must match mask_BT {tuple(mask_BT.shape)}")
    if not torch.isfinite(rewards_B).all():
        raise ValueError(f"rewards contain NaN/inf: {rewards_B.tolist()}; fix the reward function")


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards_B: torch.Tensor, group_B: torch.Tensor, mask_BT: torch.Tensor,
                   owner_BT: torch.Tensor | None, entropy_BT: torch.Tensor | None,
                   cfg: AdvantageSection) -> torch.Tensor:
    """Group-normalised outcome advantage broadcast over response tokens, then (optionally) hard attribution on
    shared prefixes and AEPO entropy-aware scaling."""
    check_inputs(rewards_B, group_B, mask_BT, owner_BT, entropy_BT)
    adv_B = group_normalized(rewards_B, group_B, cfg.eps)
    if cfg.attribution == "hard":
        if owner_BT is None:
            raise ValueError("rl.advantage.attribution=hard needs the branch tree (owner_BT); the rollout gave "
                             "none. Use attribution=soft or a branching rollout strategy (arpo/aepo)")
        adv_BT = hard_attribution(adv_B, owner_BT, mask_BT)
    else:
        adv_BT = adv_B.unsqueeze(1) * (mask_BT != 0)
    if cfg.entropy_aware and cfg.entropy_scope == "step":  # micro_batch: the loss scales (stages.rl.update)
        if entropy_BT is None:
            raise ValueError("rl.advantage.entropy_aware=true needs token entropies (entropy_BT); the trainer must "
                             "compute them whenever this flag is on")
        adv_BT = adv_BT * entropy_scaling(entropy_BT, mask_BT, cfg.entropy_alpha)
    return adv_BT


def exclude_rows(group_B: torch.Tensor, mask_BT: torch.Tensor, keep_B: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_B, mask_BT) with every row where keep_B is false moved into a group of its own (ids after the
    largest) and its mask zeroed: an estimator then gives it advantage 0 and leaves it out of every statistic."""
    keep_B = keep_B.to(torch.bool)
    if keep_B.shape != group_B.shape:
        raise ValueError(f"keep_B has shape {tuple(keep_B.shape)}; it must match group_B {tuple(group_B.shape)}")
    dropped_B = ~keep_B
    group_B = group_B.clone()
    start = int(group_B.max()) + 1 if group_B.numel() else 0
    group_B[dropped_B] = torch.arange(start, start + int(dropped_B.sum()), dtype=group_B.dtype)
    return group_B, mask_BT * keep_B.unsqueeze(1).to(mask_BT.dtype)


def compute_advantages(cfg: AdvantageSection, rewards_B: torch.Tensor, group_B: torch.Tensor,
                       mask_BT: torch.Tensor, owner_BT: torch.Tensor | None = None,
                       entropy_BT: torch.Tensor | None = None, keep_B: torch.Tensor | None = None) -> torch.Tensor:
    """Look up `cfg.estimator` in the registry and call it (the only call site the trainer uses). `keep_B`
    (bool per row, None = all): rows to train on; the others are left out (`exclude_rows`)."""
    if keep_B is not None:
        group_B, mask_BT = exclude_rows(group_B, mask_BT, keep_B)
    return ADVANTAGES.get(cfg.estimator)(rewards_B, group_B, mask_BT, owner_BT, entropy_BT, cfg)
