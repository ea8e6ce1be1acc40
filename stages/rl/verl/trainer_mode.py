"""`trainer.v1.trainer_mode=arpo_sync`: verl's synchronous trainer with our advantage step.

verl's advantage call gives an estimator rewards, the mask and the uid only. Hard attribution needs the tree
(`extra_fields` stored per trajectory by our agent-loop worker) and AEPO's entropy-aware scaling needs token
entropies; verl's `_compute_old_log_prob` already writes the old policy's full-vocabulary `entropy` into
TransferQueue (the same quantity, from the same no-grad old-policy pass, as our local engine). This override reads
both and calls `stages.rl.verl.advantage.tree_advantages` (our registry). KL-in-reward and rollout-correction
weights / rejection sampling are not used by our algorithms and are refused here rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

import transfer_queue as tq
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from stages.rl.verl.advantage import tree_advantages
from stages.rl.verl.mapping import TRAINER_MODE
from stages.rl.verl.settings import load_settings

FIELDS = ["uid", "response_mask", "rm_scores", "entropy", "extra_fields"]


def _padded(tensor):
    """verl stores per-trajectory response tensors as jagged nested tensors (no padding)."""
    return tensor.to_padded_tensor(0) if tensor.is_nested else tensor


def _as_list(value: Any) -> list[Any]:
    """Per-row python values of a non-tensor field (NonTensorStack, a stacked sub-TensorDict, or a list)."""
    if isinstance(value, TensorDict):
        return [value[i].to_dict() for i in range(value.batch_size[0])]
    return value.tolist() if hasattr(value, "tolist") else list(value)


def advantages_from_store(data: TensorDict) -> TensorDict:
    """TransferQueue fields of one step (nested per-row tensors) -> nested `advantages` and `returns`."""
    cfg = load_settings().advantage
    mask = data["response_mask"]
    padded_mask, scores = _padded(mask), _padded(data["rm_scores"])
    entropy = _padded(data["entropy"]) if cfg.entropy_aware else None
    adv = tree_advantages(cfg, scores, padded_mask, _as_list(data["uid"]), _as_list(data["extra_fields"]), entropy)
    nested = response_to_nested(adv, mask)
    return TensorDict({"advantages": nested, "returns": nested}, batch_size=[adv.shape[0]])


@register_trainer(TRAINER_MODE)
class ArpoSyncTrainer(PPOTrainerSync):
    def _compute_advantage(self, batch, metrics: dict):
        algo = self.config.algorithm
        correction = algo.get("rollout_correction", None) or {}
        if algo.use_kl_in_reward or correction.get("rollout_is", None) or correction.get("rollout_rs", None):
            raise ValueError(f"trainer_mode={TRAINER_MODE} supports neither algorithm.use_kl_in_reward nor rollout "
                             "correction weights; use rl.loss.kl_coef (KL as a loss) instead")
        fields = [f for f in FIELDS if f != "entropy" or load_settings().advantage.entropy_aware]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=advantages_from_store(data))
