"""`trainer.v1.trainer_mode=arpo_sync`: verl's synchronous trainer with our advantage step (every verl run).

- It IS verl's sync mode: verl compares the mode with the literal "sync" (v1/trainer_base.py :153 replay buffer,
  :731 gen_batch_size / exact refill, :902 TransferQueue restore, :912 re-issue on resume, :1004 TransferQueue
  checkpoint, :1499 dispatch), so `trainer_mode` reads "sync" on our class; only the registry name differs, so
  that verl's own `sync` stays untouched.
- Advantages: verl's estimator call gives rewards, the mask and the uid only. Hard attribution needs the tree
  (`extra_fields` stored per trajectory by our agent-loop worker) and AEPO's entropy-aware scaling needs token
  entropies; verl's `_compute_old_log_prob` already writes the old policy's full-vocabulary `entropy` into
  TransferQueue (the same quantity, from the same no-grad old-policy pass, as our local engine). This step reads
  both and calls our registry through `stages.rl.verl.advantage.step_advantages`: whole trees only (a partial one
  is refused), verl's padding rows get 0.
- Metrics: the same rows give the local engine's rollout metrics and the tree counts, logged through verl's
  logger as `arpo/<name>` (stages.rl.verl.monitor).
KL-in-reward and rollout-correction weights / rejection sampling are not used by our algorithms and are refused
here rather than silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from stages.rl.tree_record import TREE_FIELD
from stages.rl.verl.advantage import step_advantages, tree_metrics
from stages.rl.verl.failures import INFRA, TreeFailureLog
from stages.rl.verl.mapping import TRAINER_MODE
from stages.rl.verl.monitor import OURS, dump_row, logp_mismatch, rollout_metrics
from stages.rl.verl.settings import load_settings

# rollout_log_probs (vLLM's, rollout.calculate_log_probs: always on, mapping.py) and old_log_probs (the actor's pass)
# give the sampler-vs-trainer gap of the drift alarm
FIELDS = ["uid", "response_mask", "rm_scores", "entropy", "extra_fields", "rollout_log_probs", "old_log_probs"]


def _padded(tensor):
    """verl stores per-trajectory response tensors as jagged nested tensors (no padding)."""
    return tensor.to_padded_tensor(0) if tensor.is_nested else tensor


def _as_list(value: Any) -> list[Any]:
    """Per-row python values of a non-tensor field (NonTensorStack, a stacked sub-TensorDict, or a list)."""
    if isinstance(value, TensorDict):
        return [value[i].to_dict() for i in range(value.batch_size[0])]
    return value.tolist() if hasattr(value, "tolist") else list(value)


def advantages_from_store(data: TensorDict, padding: list[bool], n: int,
                          vocab_size: int | None = None) -> tuple[TensorDict, int, dict[str, float]]:
    """TransferQueue fields of one step (nested per-row tensors) -> (nested `advantages` / `returns`, the number
    of trees, and with `vocab_size` the local engine's rollout metrics of the real rows)."""
    settings = load_settings()
    cfg = settings.advantage
    mask = data["response_mask"]
    padded_mask, scores = _padded(mask), _padded(data["rm_scores"])
    entropy = _padded(data["entropy"]) if "entropy" in data.keys() else None
    uids, extras = _as_list(data["uid"]), _as_list(data["extra_fields"])
    adv, trees = step_advantages(cfg, scores, padded_mask, uids, extras, padding, n,
                                 entropy if cfg.entropy_aware else None, settings.alarms)
    metrics: dict[str, float] = {}
    real = [r for r, pad in enumerate(padding) if not pad]
    if vocab_size and real:
        idx = torch.tensor(real, dtype=torch.long)
        lengths = mask.offsets().diff() if mask.is_nested else torch.full((len(padding),), padded_mask.shape[1])
        model_BT = padded_mask[idx].float()
        metrics = rollout_metrics([uids[r] for r in real], [extras[r] for r in real], scores[idx].sum(-1), model_BT,
                                  lengths[idx], entropy[idx] if entropy is not None else None, vocab_size)
        metrics["advantage/mean_abs"] = float((adv[idx].abs() * model_BT).sum() / model_BT.sum().clamp(min=1))
        if "rollout_log_probs" in data.keys() and "old_log_probs" in data.keys():
            forced = [json.loads(extras[r].get(TREE_FIELD) or "{}").get("forced_eos") for r in real]
            metrics["rollout/logp_mismatch"] = logp_mismatch(_padded(data["rollout_log_probs"])[idx],
                                                             _padded(data["old_log_probs"])[idx], model_BT, forced)
    nested = response_to_nested(adv, mask)
    return TensorDict({"advantages": nested, "returns": nested}, batch_size=[adv.shape[0]]), trees, metrics


@register_trainer(TRAINER_MODE)
class ArpoSyncTrainer(PPOTrainerSync):
    """verl's sync trainer; `trainer_mode` reads "sync" (see the module docstring)."""

    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:  # PPOTrainer.__init__ assigns the configured name
        if value != TRAINER_MODE:
            raise ValueError(f"ArpoSyncTrainer runs as trainer.v1.trainer_mode={TRAINER_MODE}, not {value!r}")

    def _compute_advantage(self, batch, metrics: dict):
        algo = self.config.algorithm
        correction = algo.get("rollout_correction", None) or {}
        if algo.use_kl_in_reward or correction.get("rollout_is", None) or correction.get("rollout_rs", None):
            raise ValueError(f"trainer_mode={TRAINER_MODE} supports neither algorithm.use_kl_in_reward nor rollout "
                             "correction weights; use rl.loss.kl_coef (KL as a loss) instead")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=FIELDS)
        padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
        out, trees, ours = advantages_from_store(data, padding, int(self.config.actor_rollout_ref.rollout.n),
                                                 self._vocab_size())
        if not hasattr(self, "_arpo_failures"):  # the worker's failed trees since the previous step, by fault
            self._arpo_failures = TreeFailureLog(load_settings().tree_failures_path)
        ours |= tree_metrics(trees, int(self.config.data.train_batch_size) // self.parameter_sync_step,
                             self._arpo_failures.take()[INFRA])
        metrics.update({f"{OURS}{key}": value for key, value in ours.items()})
        if self.config.trainer.get("rollout_data_dir", None):
            self._dump_trees(batch, data, out, padding)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)

    def _dump_trees(self, batch, data: TensorDict, out: TensorDict, padding: list[bool]) -> None:
        """`<rollout_data_dir>/step_<k>.jsonl` in the local engine's dump format, tree fields included (the
        rl-rollouts artifact and the tree pages read it; verl writes its own `<k>.jsonl` beside it). The response is
        decoded as verl's reward manager decodes it."""
        from stages.core.atomic import write_jsonl
        from stages.rl.tree_record import extra_tree_fields

        more = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["responses", "reward_model", "extra_info"])
        uids, extras = _as_list(data["uid"]), _as_list(data["extra_fields"])
        samples = [{"reward_model": m, "extra_info": e} for m, e in zip(_as_list(more["reward_model"]),
                                                                        _as_list(more["extra_info"]))]
        scores, mask = _padded(data["rm_scores"]).sum(-1), data["response_mask"]
        rows = []
        for r in (r for r, pad in enumerate(padding) if not pad):
            ids = more["responses"][r]
            n = int(mask[r].numel())
            rows.append(dump_row(self.global_steps, str(uids[r]), extras[r], samples[r],
                                 self.tokenizer.decode(ids.tolist(), skip_special_tokens=True), float(scores[r]),
                                 out["advantages"][r][:n], mask[r])
                        | extra_tree_fields(extras[r], ids.tolist(), mask[r].tolist(), self.tokenizer))
        folder = Path(self.config.trainer.rollout_data_dir)
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / f"step_{self.global_steps}.jsonl", rows)

    def _vocab_size(self) -> int:
        """|V| of the policy's logits (entropy / ln|V|, as the local engine reports it)."""
        if not hasattr(self, "_arpo_vocab"):
            from transformers import AutoConfig

            self._arpo_vocab = int(AutoConfig.from_pretrained(self.config.actor_rollout_ref.model.path).vocab_size)
        return self._arpo_vocab
