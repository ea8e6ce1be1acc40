"""One RL step's tensors and the PPO update over them (mini-batches of micro-batches, grad accumulation).

`build_step_tensors`: collate the rollouts, take the old log-probs (recomputed without grad, plus entropies, or
the rollout's own: `old_logprob_source`), reference log-probs when needed, the branch owner matrix and the
advantages.
`ppo_update`: ppo_epochs x mini-batches (ppo_mini_batch_size groups each) x micro-batches; each micro-batch's
loss is weighted with the mini-batch's aggregation weights, so the accumulated gradient is exactly that of the
whole mini-batch; then gradient clipping and one optimizer step per mini-batch.

Trajectories touched by an infrastructure failure (`Trajectory.masked`: a provider, server or sandbox failed one
of its tool calls) carry no loss: their loss mask is zeroed, the advantage estimator leaves them out of their
group's statistics (`compute_advantages(keep_B=...)`), and `ppo_update` trains on the other rows only, so they do
not count in any aggregation's denominator either. A step where every trajectory is masked makes no update.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from stages.core.config.rl import RLSection
from stages.core.log import get_logger
from stages.generation.types import RolloutBatch
from stages.rl.advantages import compute_advantages, entropy_scaling, owner_matrix
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
    old_source: str = "recompute"     # recompute | rollout (old_logprob_source)
    recomputed_rows: int = 0          # rows whose old log-probs came from a no-grad pass
    keep_B: torch.Tensor | None = None  # bool: rows trained on (None = all)
    # trained tokens the sampler drew (the mask without the EOS the environment appends: its "sample log-prob" is a
    # placeholder 0), over which the sampler-vs-trainer mismatch is measured
    sampled_BT: torch.Tensor | None = None

    def select(self, rows_R: torch.Tensor) -> StepTensors:
        """The same tensors for the rows `rows_R` (long indices), in that order."""
        b = self.batch
        batch = Collated(b.input_ids_BL[rows_R], b.attention_mask_BL[rows_R], b.position_ids_BL[rows_R],
                         b.response_ids_BT[rows_R], b.valid_BT[rows_R], b.mask_BT[rows_R], b.prompt_width)

        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[rows_R]

        return StepTensors(batch, self.rewards_B[rows_R], self.group_B[rows_R], self.old_logp_BT[rows_R],
                           self.adv_BT[rows_R], pick(self.entropy_BT), pick(self.ref_logp_BT),
                           pick(self.sample_logp_BT), self.old_source, self.recomputed_rows, pick(self.keep_B),
                           pick(self.sampled_BT))


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


def old_logprob_source(cfg: RLSection, dtype: torch.dtype = torch.float32) -> str:
    """Where this step's old log-probs come from (`rl.trainer.old_logprobs`, auto resolved): "rollout" uses the
    sampler's log-probs, which come from the same weights the no-grad pass would read (the pass runs before any
    update of the step), so the pass cannot change the loss beyond float rounding (~1e-5) when the trainer
    computes in float32, the sampler's distribution is the trainer's softmax(logits / T) (no top-k / top-p
    truncation) and nothing else needs the pass (AEPO's entropy-aware advantage needs its entropies). auto also
    asks for one PPO epoch, as TRL does before it skips the pass. Otherwise "recompute"."""
    mode = cfg.trainer.old_logprobs
    if mode != "auto":
        return mode
    ro = cfg.rollout
    exact = dtype == torch.float32 and ro.top_p >= 1 and ro.top_k <= 0
    return "rollout" if exact and cfg.trainer.ppo_epochs == 1 and not cfg.advantage.entropy_aware else "recompute"


def sample_logprobs(trajs: list, width: int) -> torch.Tensor:
    """The rollout's per-token sampling log-probs [B, T] (0 on tool-result tokens and padding)."""
    sample = torch.zeros(len(trajs), width, dtype=torch.float32)
    for b, traj in enumerate(trajs):
        if traj.sample_logprobs:
            sample[b, :len(traj.sample_logprobs)] = torch.tensor(traj.sample_logprobs, dtype=torch.float32)
    return sample


def sampled_mask(trajs: list, mask_BT: torch.Tensor) -> torch.Tensor:
    """`mask_BT` without the tokens the sampler did not draw: the EOS the environment appends after a refused call
    (meta forced_eos; its sample log-prob is a placeholder 0, 17 nats from the trainer's on a real run)."""
    sampled = mask_BT.clone()
    for b, traj in enumerate(trajs):
        at = traj.meta.get("forced_eos")
        if at is not None and at < sampled.shape[1]:
            sampled[b, at] = 0
    return sampled


def _old_logprobs(cfg: RLSection, model: torch.nn.Module, trajs: list, batch: Collated, sample: torch.Tensor,
                  source: str, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(old log-probs, their entropies or None, rows recomputed). Under "rollout" only rows holding a token the
    policy did not sample are recomputed: the EOS the environment appends (meta forced_eos, sample log-prob 0)."""
    tc, temperature = cfg.trainer, cfg.rollout.temperature
    if source == "recompute":
        logp, entropy = batched_forward(model, batch, tc.micro_batch_size, temperature, True, device, tc.shared_prompt)
        return logp, entropy, batch.rows
    old = sample.clone()
    rows = [b for b, t in enumerate(trajs) if "forced_eos" in t.meta]
    if rows:
        sub = collate([trajs[b] for b in rows], pad_id)
        logp, _ = batched_forward(model, sub, tc.micro_batch_size, temperature, False, device, tc.shared_prompt)
        for i, b in enumerate(rows):
            old[b, :sub.width] = logp[i]
    return old, None, len(rows)


def build_step_tensors(cfg: RLSection, model: torch.nn.Module, ref_model: torch.nn.Module | None,
                       rollouts: RolloutBatch, rewards: list[float], pad_id: int,
                       device: torch.device, dtype: torch.dtype = torch.float32) -> StepTensors:
    trajs = rollouts.trajectories
    batch = collate(trajs, pad_id)
    temperature = cfg.rollout.temperature
    micro = cfg.trainer.micro_batch_size
    source = old_logprob_source(cfg, dtype)
    sample = sample_logprobs(trajs, batch.width)
    was_training = model.training
    model.eval()
    with autocast(device, dtype):
        old_logp, entropy, recomputed = _old_logprobs(cfg, model, trajs, batch, sample, source, pad_id, device)
        ref_logp = None
        if ref_model is not None:
            ref_logp, _ = batched_forward(ref_model, batch, micro, temperature, False, device,
                                          cfg.trainer.shared_prompt)
    model.train(was_training)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    group_B = torch.tensor([t.group for t in trajs], dtype=torch.long)
    keep_B = torch.tensor([not t.masked for t in trajs], dtype=torch.bool)
    batch.mask_BT *= keep_B.unsqueeze(1).to(batch.mask_BT.dtype)  # no loss on what an outage touched
    owner_BT = None
    if cfg.advantage.attribution == "hard":
        parents, forks = branch_parents(rollouts)  # masked rows stay in the tree (they link shared prefixes)
        owner_BT = owner_matrix(parents, forks, batch.width)
    adv_BT = compute_advantages(cfg.advantage, rewards_B, group_B, batch.mask_BT, owner_BT,
                                entropy if step_entropy_scaling(cfg) else None, keep_B)
    return StepTensors(batch, rewards_B, group_B, old_logp, adv_BT, entropy, ref_logp, sample, source, recomputed,
                       keep_B, sampled_mask(trajs, batch.mask_BT))


def _trim(batch: Collated) -> tuple[Collated, int]:
    """Drop columns that are padding in every row of this micro-batch; returns it and its response width."""
    prompt_cols = batch.attention_mask_BL[:, :batch.prompt_width].sum(dim=1)
    p = int(prompt_cols.max())
    t = max(1, int(batch.valid_BT.sum(dim=1).max()))
    start, stop = batch.prompt_width - p, batch.prompt_width + t
    return Collated(batch.input_ids_BL[:, start:stop], batch.attention_mask_BL[:, start:stop],
                    batch.position_ids_BL[:, start:stop], batch.response_ids_BT[:, :t], batch.valid_BT[:, :t],
                    batch.mask_BT[:, :t], p), t


def step_entropy_scaling(cfg: RLSection) -> bool:
    """AEPO's entropy-aware advantage from the old policy's entropies standardised over the whole step."""
    return cfg.advantage.entropy_aware and cfg.advantage.entropy_scope == "step"


def micro_entropy_scaling(cfg: RLSection) -> bool:
    """... or, as the reference's loss does, from the current policy's entropies standardised per micro-batch."""
    return cfg.advantage.entropy_aware and cfg.advantage.entropy_scope == "micro_batch"


def _micro_loss(cfg: RLSection, model: torch.nn.Module, data: StepTensors, rows: slice, weights_BT: torch.Tensor,
                device: torch.device, dtype: torch.dtype, observe: bool = False
                ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, torch.Tensor | None]:
    """The micro-batch's weighted loss and statistics, its log-probs (detached) and, with `observe` or an entropy
    bonus, its token entropies (detached) -- what the skipped old-log-prob pass would have reported."""
    micro, t = _trim(data.batch.rows_slice(rows.start, rows.stop))
    micro = micro.to(device)
    bonus = cfg.loss.entropy_coef != 0
    with autocast(device, dtype):
        logp, entropy = policy_forward(model, micro, cfg.rollout.temperature,
                                       bonus or observe or micro_entropy_scaling(cfg), cfg.trainer.shared_prompt,
                                       detach_entropy=not bonus)

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[rows, :t].to(device)

    adv_BT = cut(data.adv_BT)
    if micro_entropy_scaling(cfg):
        adv_BT = adv_BT * entropy_scaling(entropy.float(), micro.mask_BT, cfg.advantage.entropy_alpha)
    loss_BT, stats = total_token_loss(cfg.loss, logp.float(), cut(data.old_logp_BT), adv_BT, micro.mask_BT,
                                      cut(data.ref_logp_BT), entropy if bonus else None)
    seen = None if entropy is None else entropy.detach().float().cpu()
    return (loss_BT * cut(weights_BT)).sum(), stats, logp.detach().float().cpu(), seen


def _observe(data: StepTensors, rows: slice, logp: torch.Tensor, entropy: torch.Tensor | None,
             before_update: bool, mismatch: list[float]) -> None:
    """With the rollout's log-probs as old ones, the update's own forward supplies the entropies (first epoch) and,
    before the first optimizer step, the sampler-vs-trainer log-prob mismatch (sum |diff|, tokens)."""
    t = logp.shape[1]
    if entropy is not None:
        data.entropy_BT[rows, :t] = entropy
    if before_update and data.sample_logp_BT is not None:
        mask = (data.batch.mask_BT if data.sampled_BT is None else data.sampled_BT)[rows, :t]
        mismatch[0] += float(((data.sample_logp_BT[rows, :t] - logp).abs() * mask).sum())
        mismatch[1] += float(mask.sum())


def ppo_update(cfg: RLSection, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: StepTensors,
               group_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Returns mean statistics over micro-batches plus grad norm and the number of optimizer steps. Only the rows
    `data.keep_B` marks are trained on (the others were touched by an infrastructure failure)."""
    tc = cfg.trainer
    observe = data.old_source == "rollout"  # the old-log-prob pass was skipped: report what it would have
    if observe and data.entropy_BT is None:
        data.entropy_BT = torch.zeros_like(data.adv_BT)
    whole, kept_R = data, None
    if data.keep_B is not None and not bool(data.keep_B.all()):
        kept_R = torch.nonzero(data.keep_B).squeeze(1)
        data = data.select(kept_R)
    rows = data.batch.rows
    mini_rows = max(1, tc.ppo_mini_batch_size * group_size)
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    counts = 0
    norms: list[float] = []
    skipped = 0
    mismatch = [0.0, 0.0]
    model.train()
    for epoch in range(tc.ppo_epochs):
        for m_start in range(0, rows, mini_rows):
            m_stop = min(rows, m_start + mini_rows)
            weights = torch.zeros_like(data.adv_BT)
            weights[m_start:m_stop] = aggregation_weights(cfg.loss.aggregation, data.batch.mask_BT[m_start:m_stop],
                                                          cfg.rollout.max_response_length, tc.micro_batch_size)
            optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for start in range(m_start, m_stop, tc.micro_batch_size):
                micro = slice(start, min(m_stop, start + tc.micro_batch_size))
                loss, stats, logp, entropy = _micro_loss(cfg, model, data, micro, weights, device, dtype,
                                                         observe and epoch == 0)
                if observe and epoch == 0:
                    _observe(data, micro, logp, entropy, not norms and not skipped, mismatch)
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
    if observe and mismatch[1]:
        out["rollout/logp_mismatch"] = mismatch[0] / mismatch[1]
    if observe and kept_R is not None:
        whole.entropy_BT[kept_R] = data.entropy_BT  # the trained rows' entropies back into the step's tensors
    return out
