"""Policy losses, loss aggregation and KL penalties: pure functions over tensors, each kind in its registry.

Policy losses share one signature and return the per-token loss matrix (not yet aggregated) plus statistics:

    fn(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg: LossSection) -> (loss_BT, stats)

Aggregations turn a mini-batch's mask into per-token weights, so a mini-batch split into micro-batches for
gradient accumulation sums to exactly the weighted loss of the whole mini-batch:

    fn(mask_BT, norm_len, micro_rows) -> weight_BT          loss = sum(loss_BT * weight_BT)

(micro_rows = trajectories per micro-batch; only the reference's per-micro-batch mode depends on it.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.core.config.rl import LossSection
from stages.core.registry import Registry

PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossSection],
                        tuple[torch.Tensor, dict[str, float]]]
AggregationFn = Callable[[torch.Tensor, int, int], torch.Tensor]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")

LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here before exp, as verl does, so one wild token cannot overflow
K3_LIMIT = 10.0         # k3 is clamped to [-10, 10] as the reference's and verl's low_var_kl (docs/reference.md)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def _ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return log_ratio_BT, torch.exp(log_ratio_BT)


def _dual_clip(adv_BT: torch.Tensor, unclipped_BT: torch.Tensor, clipped_BT: torch.Tensor, mask_BT: torch.Tensor,
               log_ratio_BT: torch.Tensor, clip_c: float) -> tuple[torch.Tensor, dict[str, float]]:
    """max(-A r, -A clip(r)), then for A < 0 also capped at -A c (the dual clip)."""
    pg_max_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = torch.minimum(pg_max_BT, -adv_BT * clip_c)
    loss_BT = torch.where(adv_BT < 0, dual_BT, pg_max_BT)
    mask_f = mask_BT.to(loss_BT.dtype)
    with torch.no_grad():
        stats = {
            "clip_fraction": float(masked_mean((clipped_BT > unclipped_BT).to(mask_f.dtype), mask_f)),
            "dual_clip_fraction": float(masked_mean(((adv_BT < 0) & (pg_max_BT > -adv_BT * clip_c))
                                                    .to(mask_f.dtype), mask_f)),
            "ppo_kl": float(masked_mean(-log_ratio_BT, mask_f)),
        }
    return loss_BT * mask_f, stats


@POLICY_LOSSES.register("ppo_dual_clip")
def ppo_dual_clip(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, mask_BT: torch.Tensor,
                  cfg: LossSection) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO: L = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); for A < 0, L = min(L, -A c)."""
    log_ratio_BT, ratio_BT = _ratio(logp_BT, old_logp_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return _dual_clip(adv_BT, unclipped_BT, clipped_BT, mask_BT, log_ratio_BT, cfg.clip_ratio_c)


@POLICY_LOSSES.register("aepo_balanced_clip")
def aepo_balanced_clip(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor,
                       mask_BT: torch.Tensor, cfg: LossSection) -> tuple[torch.Tensor, dict[str, float]]:
    """AEPO entropy-balanced clipping: the upper bound is (1+eps_high) * r / sg(r), whose value is 1+eps_high
    but whose gradient is (1+eps_high) * grad log pi, so tokens above the bound keep a (rescaled) gradient.
    The lower bound stays the constant 1-eps_low (zero gradient below it when it binds)."""
    log_ratio_BT, ratio_BT = _ratio(logp_BT, old_logp_BT)
    upper_BT = (1.0 + cfg.clip_ratio_high) * ratio_BT / ratio_BT.detach()
    lower = 1.0 - cfg.clip_ratio_low
    clipped_ratio_BT = torch.where(ratio_BT > 1.0 + cfg.clip_ratio_high, upper_BT,
                                   torch.where(ratio_BT < lower, torch.full_like(ratio_BT, lower), ratio_BT))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * clipped_ratio_BT
    return _dual_clip(adv_BT, unclipped_BT, clipped_BT, mask_BT, log_ratio_BT, cfg.clip_ratio_c)


@AGGREGATIONS.register("token_mean")
def token_mean(mask_BT: torch.Tensor, norm_len: int, micro_rows: int) -> torch.Tensor:
    """Every valid token of the mini-batch weighs the same: 1 / (number of valid tokens)."""
    mask_f = mask_BT.to(torch.float32)
    return mask_f / mask_f.sum().clamp(min=1)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(mask_BT: torch.Tensor, norm_len: int, micro_rows: int) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean: 1 / (B * len_b). Rows without valid tokens count in B
    (they contribute 0), as verl's seq-mean does."""
    mask_f = mask_BT.to(torch.float32)
    lengths_B = mask_f.sum(dim=1, keepdim=True).clamp(min=1)
    return mask_f / (lengths_B * mask_f.shape[0])


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(mask_BT: torch.Tensor, norm_len: int, micro_rows: int) -> torch.Tensor:
    """Dr. GRPO: mean over sequences of the token sum divided by a constant length (the response budget):
    1 / (B * norm_len). (verl's version divides the sum over sequences by the padded width and not by B.)"""
    if norm_len <= 0:
        raise ValueError(f"seq_mean_token_sum_norm needs a positive constant length, got {norm_len}; pass "
                         "rl.rollout.max_response_length")
    mask_f = mask_BT.to(torch.float32)
    return mask_f / (mask_f.shape[0] * norm_len)


@AGGREGATIONS.register("micro_token_mean")
def micro_token_mean(mask_BT: torch.Tensor, norm_len: int, micro_rows: int) -> torch.Tensor:
    """The reference's weighting (verl 0.3 fork dp_actor.py: token mean of each micro-batch, scaled by its share
    of the mini-batch's sequences): token t of micro-batch m weighs (|m| / M) / T_m (|m| rows, T_m valid tokens
    in m, M rows in the mini-batch). Relative to token_mean a token weighs mean length of the mini-batch / mean
    length of its micro-batch: tokens of short micro-batches count more."""
    if micro_rows <= 0:
        raise ValueError(f"micro_token_mean needs a positive micro-batch size, got {micro_rows}; pass "
                         "rl.trainer.micro_batch_size")
    mask_f = mask_BT.to(torch.float32)
    rows = mask_f.shape[0]
    weights_BT = torch.zeros_like(mask_f)
    for start in range(0, rows, micro_rows):
        part = mask_f[start:start + micro_rows]
        weights_BT[start:start + micro_rows] = part / part.sum().clamp(min=1) * (part.shape[0] / rows)
    return weights_BT


def aggregation_weights(mode: str, mask_BT: torch.Tensor, norm_len: int, micro_rows: int | None = None
                        ) -> torch.Tensor:
    """Per-token weights of one mini-batch; `micro_rows` None = the mini-batch is one micro-batch."""
    return AGGREGATIONS.get(mode)(mask_BT, norm_len, micro_rows or mask_BT.shape[0])


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, norm_len: int,
              micro_rows: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss matrix over one (mini-)batch."""
    return (loss_BT * aggregation_weights(mode, mask_BT, norm_len, micro_rows).to(loss_BT.dtype)).sum()


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of pi || pi_ref from sampled tokens (Schulman's estimators).

    k1 = log pi - log pi_ref (unbiased, high variance, can be negative);
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (>= 0), verl's low_var_kl: the log ratio is clamped
    to +-20 before exp and the estimate to [-10, 10] (so its gradient is 0 where it exceeds 10)."""
    if kind == "k1":
        return logp_BT - ref_logp_BT
    if kind == "k3":
        log_ratio_BT = (ref_logp_BT - logp_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.exp(log_ratio_BT) - log_ratio_BT - 1.0).clamp(-K3_LIMIT, K3_LIMIT)
    raise ValueError(f"unknown KL estimator {kind!r}; use rl.loss.kl_type=k1 or k3")


def total_token_loss(cfg: LossSection, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor,
                     mask_BT: torch.Tensor, ref_logp_BT: torch.Tensor | None = None,
                     entropy_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss + kl_coef * KL - entropy_coef * H, per token (masked), with statistics."""
    loss_BT, stats = POLICY_LOSSES.get(cfg.policy_loss)(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg)
    mask_f = mask_BT.to(loss_BT.dtype)
    if cfg.kl_coef > 0:
        if ref_logp_BT is None:
            raise ValueError("rl.loss.kl_coef > 0 needs reference log-probs; the trainer loads the reference "
                             "model only when kl_coef > 0")
        kl_BT = kl_penalty(logp_BT, ref_logp_BT, cfg.kl_type)
        loss_BT = loss_BT + cfg.kl_coef * kl_BT * mask_f
        stats["kl"] = float(masked_mean(kl_BT.detach(), mask_f))
    if cfg.entropy_coef != 0:
        if entropy_BT is None:
            raise ValueError("rl.loss.entropy_coef != 0 needs token entropies with gradient")
        loss_BT = loss_BT - cfg.entropy_coef * entropy_BT * mask_f
    return loss_BT, stats
