"""One RL step's tensors and the PPO update over them (mini-batches of micro-batches, grad accumulation).

`build_step_tensors`: collate the rollouts, recompute old log-probs (no grad; plus entropies and reference
log-probs when needed), build the branch owner matrix and the advantages.
`ppo_update`: ppo_epochs x mini-batches (ppo_mini_batch_size groups each) x micro-batches; each micro-batch's
loss is weighted with the mini-batch's aggregation weights, so the accumulated gradient is exactly that of the
whole mini-batch; then gradient clipping and one optimizer step per mini-batch.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from stages.core.config.rl import RLSection
from stages.core.log import get_logger
from stages.generation.types import RolloutBatch
from stages.rl.advantages import compute_advantages, owner_matrix
from stages.rl.logprobs import Collated, batched_forward, collate, policy_forward
from stages.rl.losses import aggregation_weights, total_token_loss

log = get_logger(__name__)


@dataclass
class StepTensors:
    batch: Collated
    rewards_B: torch.Tensor
    group_B: torch.Tensor
    old_logp_BT: torch.Tensor
    adv_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None
    ref_logp_BT: torch.Tensor | None = None
    sample_logp_BT: torch.Tensor | None = None


def branch_parents(rollouts: RolloutBatch) -> tuple[list[int | None], list[int]]:
    """Row index of each trajectory's parent (None for roots/fresh samples or a parent not in the batch)."""
    trajs = rollouts.trajectories
    row_of = {(t.group, t.traj_id): i for i, t in enumerate(trajs)}
    parents, forks = [], []
    for i, traj in enumerate(trajs):
        parent = row_of.get((traj.group, traj.parent_id)) if traj.parent_id is not None else None
        if parent is not None and parent >= i:
            parent = None  # not in creation order: treat as unshared rather than guess
        parents.append(parent)
        forks.append(traj.fork_at if parent is not None else 0)
    return parents, forks


def autocast(device: torch.device, dtype: torch.dtype = torch.float32):
    """Compute in `dtype` (model.dtype) over float32 master weights; float32 = no autocast."""
    return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def build_step_tensors(cfg: RLSection, model: torch.nn.Module, ref_model: torch.nn.Module | None,
                       rollouts: RolloutBatch, rewards: list[float], pad_id: int,
                       device: torch.device, dtype: torch.dtype = torch.float32) -> StepTensors:
    trajs = rollouts.trajectories
    batch = collate(trajs, pad_id)
    temperature = cfg.rollout.temperature
    micro = cfg.trainer.micro_batch_size
    was_training = model.training
    model.eval()
    with autocast(device, dtype):
        old_logp, entropy = batched_forward(model, batch, micro, temperature, True, device)
        ref_logp = None
        if ref_model is not None:
            ref_logp, _ = batched_forward(ref_model, batch, micro, temperature, False, device)
    model.train(was_training)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    group_B = torch.tensor([t.group for t in trajs], dtype=torch.long)
    owner_BT = None
    if cfg.advantage.attribution == "hard":
        parents, forks = branch_parents(rollouts)
        owner_BT = owner_matrix(parents, forks, batch.width)
    adv_BT = compute_advantages(cfg.advantage, rewards_B, group_B, batch.mask_BT, owner_BT,
                                entropy if cfg.advantage.entropy_aware else None)
    sample = torch.zeros_like(old_logp)
    for b, traj in enumerate(trajs):
        if traj.sample_logprobs:
            sample[b, :len(traj.sample_logprobs)] = torch.tensor(traj.sample_logprobs, dtype=torch.float32)
    return StepTensors(batch, rewards_B, group_B, old_logp, adv_BT, entropy, ref_logp, sample)


def _trim(batch: Collated) -> tuple[Collated, int]:
    """Drop columns that are padding in every row of this micro-batch; returns it and its response width."""
    prompt_cols = batch.attention_mask_BL[:, :batch.prompt_width].sum(dim=1)
    p = int(prompt_cols.max())
    t = max(1, int(batch.valid_BT.sum(dim=1).max()))
    start, stop = batch.prompt_width - p, batch.prompt_width + t
    return Collated(batch.input_ids_BL[:, start:stop], batch.attention_mask_BL[:, start:stop],
                    batch.position_ids_BL[:, start:stop], batch.response_ids_BT[:, :t], batch.valid_BT[:, :t],
                    batch.mask_BT[:, :t], p), t


def _micro_loss(cfg: RLSection, model: torch.nn.Module, data: StepTensors, rows: slice, weights_BT: torch.Tensor,
                device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, float]]:
    micro, t = _trim(data.batch.rows_slice(rows.start, rows.stop))
    micro = micro.to(device)
    with autocast(device, dtype):
        logp, entropy = policy_forward(model, micro, cfg.rollout.temperature, cfg.loss.entropy_coef != 0)

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[rows, :t].to(device)

    loss_BT, stats = total_token_loss(cfg.loss, logp.float(), cut(data.old_logp_BT), cut(data.adv_BT), micro.mask_BT,
                                      cut(data.ref_logp_BT), entropy)
    return (loss_BT * cut(weights_BT)).sum(), stats


def ppo_update(cfg: RLSection, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: StepTensors,
               group_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Returns mean statistics over micro-batches plus grad norm and the number of optimizer steps."""
    tc = cfg.trainer
    rows = data.batch.rows
    mini_rows = max(1, tc.ppo_mini_batch_size * group_size)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    counts = 0
    norms: list[float] = []
    skipped = 0
    model.train()
    for _ in range(tc.ppo_epochs):
        for m_start in range(0, rows, mini_rows):
            m_stop = min(rows, m_start + mini_rows)
            weights = torch.zeros_like(data.adv_BT)
            weights[m_start:m_stop] = aggregation_weights(cfg.loss.aggregation, data.batch.mask_BT[m_start:m_stop],
                                                          cfg.rollout.max_response_length)
            optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for start in range(m_start, m_stop, tc.micro_batch_size):
                loss, stats = _micro_loss(cfg, model, data, slice(start, min(m_stop, start + tc.micro_batch_size)),
                                          weights, device, dtype)
                loss.backward()
                loss_total += float(loss.detach())
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                counts += 1
            norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
            if not math.isfinite(norm):
                log.warning("non-finite gradient norm (%s); skipping this optimizer step", norm)
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            norms.append(norm)
            sums["loss"] = sums.get("loss", 0.0) + loss_total
    out = {key: value / max(counts, 1) for key, value in sums.items() if key != "loss"}
    updates = len(norms)
    out |= {"loss": sums.get("loss", 0.0) / max(updates, 1), "grad_norm": sum(norms) / max(updates, 1),
            "optimizer_steps": float(updates), "skipped_steps": float(skipped)}
    return out
