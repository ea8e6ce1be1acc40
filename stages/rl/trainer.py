"""The local RL engine (`rl.engine: local`): an on-policy loop over the train set, checkpointed, resumable after a
crash; the stage entry `run_rl` (stages/rl/stage.py) reaches it through the engine registry (engines.py).

Per step: the next `train_batch_size` prompts -> rollouts (TreeRollout: tools, branching) -> rewards ->
old log-probs, entropies (and reference log-probs when kl_coef > 0) -> advantages -> ppo_epochs x mini-batches
of micro-batches -> metrics row, rollout dump, alarms (stages/rl/alarms.py) -> checkpoint every `save_every` steps
and at the end; progress, curves and a rollout sample are reported while it runs (stages.core.reporter).

Resume: `run_rl` (stage.py) re-run on the same inputs lands in the same stage folder; the trainer loads the newest complete
checkpoint (weights, optimizer, RNG states, step / data position), rewrites metrics.jsonl to the steps that
checkpoint holds, and continues with the next step. The data order of every epoch is a seeded permutation and
each step's rollout seed is derived from (seed, step), so a resumed run samples what the uninterrupted one would.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.agent.rewards import compute_rewards
from stages.core import reporter, tracking
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.config.rl_engine import local_engine_problem
from stages.core.errors import BadInputError
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.core.rl_parquet import RLRow, read_rl_parquet
from stages.generation.generate_watch import GenerateTimeout, stuck_generate
from stages.generation.models import load_policy, load_tokenizer
from stages.generation.session import RolloutSession
from stages.generation.types import RolloutBatch
from stages.rl import checkpoint as ckpt
from stages.rl.alarms import AlarmWatch
from stages.rl.identity import training_identity
from stages.rl.modeling import (
    compute_dtype,
    configure_for_training,
    device_memory_gb,
    parameters_billion,
    pick_device,
)
from stages.rl.probe import write_probe
from stages.rl.publish import publish_results
from stages.rl.rollout import tree_rollouts
from stages.rl.step_metrics import (
    append_metrics,
    dump_rollouts,
    plot_curves,
    reconcile_metrics,
    rollout_metrics,
    step_note,
)
from stages.rl.tree_report import finish_pages
from stages.rl.update import build_step_tensors, ppo_update

log = get_logger(__name__)


def run_local(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
              stage: Path, cache_root: Path, seed: int, dtype: str) -> CheckpointRef:
    """The local engine: this process, one device."""
    trainer = RLTrainer(cfg, agent, policy, data, stage, cache_root, seed, dtype=dtype)
    final = trainer.train()
    return CheckpointRef(path=str(final), fingerprint="", format="trainer", step=trainer.total_steps,
                         meta={"metrics": str(stage / "metrics.jsonl"), "curves": str(stage / "curves.png"),
                               "rollouts": str(stage / "rollouts")})


def step_counts(n_rows: int, cfg: RLSection) -> tuple[int, int]:
    """(steps per epoch, total steps). Incomplete last batches are dropped, as the reference does."""
    per_epoch = n_rows // cfg.trainer.train_batch_size
    if per_epoch == 0:
        raise BadInputError(f"the RL train set has {n_rows} rows, fewer than rl.trainer.train_batch_size="
                            f"{cfg.trainer.train_batch_size}; lower train_batch_size or add data")
    total = cfg.trainer.total_steps or per_epoch * cfg.trainer.epochs
    return per_epoch, total


def rollout_seed(seed: int, step: int) -> int:
    """The tree rollout's seed for 0-based `step`: a pure function of the run seed, so resuming reproduces it."""
    return int(hash_value("rl-rollout", seed, step), 16) % 2**31


def epoch_order(n_rows: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_rows))
    random.Random(hash_value("rl-data-order", seed, epoch)).shuffle(order)
    return order


def step_batch(n_rows: int, seed: int, step: int, per_epoch: int, size: int) -> tuple[list[int], int, int]:
    """(the train-set rows of 0-based `step`, its epoch, its position in the epoch): a pure function of (seed, step),
    so a resumed run takes the same prompts, and so does the learning bench's SFT baseline on each step's prompts
    (bench/learning_baseline.py calls this, not a copy)."""
    epoch, position = divmod(step, per_epoch)
    return epoch_order(n_rows, seed, epoch)[position * size:(position + 1) * size], epoch, position


def make_optimizer(model: torch.nn.Module, cfg: RLSection) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; the fused kernel when the parameters allow it (about 6x faster per
    step than the default loop on CPU for the 135M tiny model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) and p.device.type in ("cpu", "cuda")
                for p in params)
    return torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay,
                             fused=fused or None)


@contextmanager
def phase(times: dict[str, float], name: str):
    """Wall and process CPU seconds of one phase of a step, as `<name>_s` and `<name>_cpu_s`."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        times[f"{name}_s"] = time.perf_counter() - wall
        times[f"{name}_cpu_s"] = time.process_time() - cpu


class RLTrainer:
    def __init__(self, cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
                 stage_path: Path, cache_root: Path, seed: int = 0, toolbox: Any = None,
                 dtype: str = "float32") -> None:
        self.cfg, self.agent, self.policy, self.data, self.toolbox = cfg, agent, policy, data, toolbox
        self.path, self.cache_root, self.seed = Path(stage_path), Path(cache_root), seed
        self.rows: list[RLRow] = read_rl_parquet(data.file("rl_train"))
        self.steps_per_epoch, self.total_steps = step_counts(len(self.rows), cfg)
        self.ckpt_root = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.device = pick_device()
        self.dtype = compute_dtype(dtype)
        self.config_hash = hash_value(training_identity(cfg), agent, seed)
        self.resumed_from: int | None = None  # the checkpoint step this process resumed from
        self.watch = AlarmWatch(cfg.alarms, self.path / "alarms.jsonl")  # train() reloads it at the resumed step

    # ---- set-up -------------------------------------------------------------------------------------------
    def _load(self) -> tuple[ckpt.TrainerState, Path | None]:
        latest = ckpt.latest_checkpoint(self.ckpt_root)
        self.check_memory()
        self.tokenizer = load_tokenizer(self.policy)
        source = ModelRef(path=str(latest / "model"), fingerprint="resume") if latest else self.policy
        self.model = configure_for_training(load_policy(source, torch.float32).to(self.device),
                                            self.cfg.trainer.gradient_checkpointing)
        self.ref_model = None
        if self.cfg.loss.kl_coef > 0:  # the frozen reference exists only when it contributes
            self.ref_model = load_policy(self.policy, torch.float32).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        self.optimizer = make_optimizer(self.model, self.cfg)
        if latest is None:
            random.seed(self.seed)
            np.random.seed(self.seed % 2**32)
            torch.manual_seed(self.seed)
            return ckpt.TrainerState(step=0, epoch=0, position=0, config_hash=self.config_hash), None
        state = ckpt.load_training_state(latest, self.optimizer)
        self.resumed_from = state.step
        if state.config_hash and state.config_hash != self.config_hash:
            raise RuntimeError(f"checkpoint {latest} was written under another configuration; delete "
                               f"{self.ckpt_root} or run with force=True to start over")
        return state, latest

    def check_memory(self) -> None:
        """Refuse, before loading weights, a policy this device cannot train (exact size from its config)."""
        params = parameters_billion(self.policy)
        problem = local_engine_problem(params, device_memory_gb(self.device, self.cfg.local_memory_gb),
                                       self.cfg.rollout.backend, self.cfg.loss.kl_coef > 0)
        if problem:
            raise MemoryError(problem)

    def train(self) -> Path:
        state, latest = self._load()
        if latest is not None:
            log.info("rl: resuming from checkpoint step %d of %d (%s)", state.step, self.total_steps, latest)
        history = reconcile_metrics(self.metrics_path, state.step, state.metrics if latest else None)
        for done in history:  # a resumed run's tracker run gets the steps before the crash too
            tracking.log_step(done)
        self.watch = AlarmWatch(self.cfg.alarms, self.path / "alarms.jsonl", resumed_step=state.step)
        pad_id = self.tokenizer.pad_token_id
        session = RolloutSession(self.cfg.rollout.generation(), self.agent, self.model, self.tokenizer, self.data,
                                 self.cache_root, self.seed, self.toolbox,
                                 make_rollout=tree_rollouts(self.cfg.rollout, self.cfg.algorithm))
        try:
            with reporter.track("rl", f"RL ({self.cfg.algorithm})", total=self.total_steps, done=state.step) as bar:
                while state.step < self.total_steps:
                    try:
                        row = self.step(state, session, pad_id, history)
                    except GenerateTimeout as err:
                        raise stuck_generate(err, self.path, state.step + 1) from None
                    history.append(row)
                    tracking.log_step(row)  # the stage's tracker run (stages.core.tracking), same names
                    bar.update(state.step, note=step_note(row))
                    if state.step % self.cfg.trainer.report_every == 0 or state.step == self.total_steps:
                        publish_results(self.cfg, self.path, history)
        finally:
            session.close()
            finish_pages(self.cfg, self.path)  # an alarm stop included: a tree page per dump (tree_report.py)
        final = self._final_checkpoint(state, latest)
        plot_curves(history, self.path / "curves.png")
        return final

    def _final_checkpoint(self, state: ckpt.TrainerState, latest: Path | None) -> Path:
        final = ckpt.latest_checkpoint(self.ckpt_root)
        if final is None or ckpt.read_state(final).step != state.step:
            final = ckpt.save_checkpoint(self.ckpt_root, state, self.model, self.tokenizer, self.optimizer,
                                         keep=self.cfg.trainer.keep_checkpoints)
        write_probe(final, self.model, self.tokenizer)
        return final

    # ---- one step -----------------------------------------------------------------------------------------
    def batch_rows(self, step: int) -> tuple[list[RLRow], int, int]:
        rows, epoch, position = step_batch(len(self.rows), self.seed, step, self.steps_per_epoch,
                                           self.cfg.trainer.train_batch_size)
        return [self.rows[i] for i in rows], epoch, position

    def step(self, state: ckpt.TrainerState, session: RolloutSession, pad_id: int,
             history: list[dict[str, Any]]) -> dict[str, Any]:
        times: dict[str, float] = {}
        start, cpu_start = time.perf_counter(), time.process_time()
        rows, epoch, position = self.batch_rows(state.step)
        with phase(times, "rollout"):
            rollouts = session.rollout(rows, seed=rollout_seed(self.seed, state.step))
        with phase(times, "reward"):
            rewards = compute_rewards(self.cfg.trainer.reward, [t.response_text for t in rollouts.trajectories],
                                      *self._truths(rollouts))
        with phase(times, "old_logprob"):
            tensors = build_step_tensors(self.cfg, self.model, self.ref_model, rollouts, [r.score for r in rewards],
                                         pad_id, self.device, self.dtype)
        with phase(times, "update"):
            update = ppo_update(self.cfg, self.model, self.optimizer, tensors, self.cfg.rollout.n, self.device,
                                self.dtype)
        state.step += 1
        state.epoch, state.position = divmod(state.step, self.steps_per_epoch)
        row = {"step": state.step, "epoch": epoch, "batch_position": position, "pid": os.getpid(),
               "resumed_from": self.resumed_from,
               **rollout_metrics(rollouts, rewards), **self._tensor_metrics(tensors), **update}
        self._dump(state.step, rollouts, rewards, tensors)
        row |= {f"timing/{k}": v for k, v in times.items()}
        self.watch.check([*history, row])  # may stop the run before this step is saved
        t0 = time.perf_counter()
        state.metrics = row
        if state.step % self.cfg.trainer.save_every == 0 or state.step == self.total_steps:
            ckpt.save_checkpoint(self.ckpt_root, state, self.model, self.tokenizer, self.optimizer,
                                 keep=self.cfg.trainer.keep_checkpoints)
        row["timing/checkpoint_s"] = time.perf_counter() - t0
        row["timing/step_s"] = time.perf_counter() - start
        row["timing/step_cpu_s"] = time.process_time() - cpu_start  # all threads of this process (vLLM's too)
        append_metrics(self.metrics_path, row)
        log.info("step %d/%d reward %.3f acc %.2f tools/traj %.2f entropy %.3f (%.1fs)", state.step,
                 self.total_steps, row["reward/mean"], row["accuracy"], row["tools/calls_per_traj"],
                 row["entropy/mean"], row["timing/step_s"])
        return row

    @staticmethod
    def _truths(rollouts: RolloutBatch) -> tuple[list[str], list[str]]:
        truths = [g.ground_truth for g in rollouts.groups for _ in g.trajectories]
        abilities = [g.ability for g in rollouts.groups for _ in g.trajectories]
        return truths, abilities

    @staticmethod
    def _tensor_metrics(tensors) -> dict[str, float]:
        mask = tensors.batch.mask_BT
        n = mask.sum().clamp(min=1)
        out = {"entropy/mean": float((tensors.entropy_BT * mask).sum() / n),
               "advantage/mean_abs": float((tensors.adv_BT.abs() * mask).sum() / n),
               "old_logprob/recomputed_rows": float(tensors.recomputed_rows),
               "old_logprob/from_rollout": float(tensors.old_source == "rollout")}
        if tensors.old_source == "recompute":  # else the update measured it (before its first optimizer step)
            sampled = mask if tensors.sampled_BT is None else tensors.sampled_BT  # not the environment's EOS
            out["rollout/logp_mismatch"] = float(((tensors.sample_logp_BT - tensors.old_logp_BT).abs() * sampled).sum()
                                                 / sampled.sum().clamp(min=1))
        if tensors.ref_logp_BT is not None:
            out["kl/ref"] = float(((tensors.old_logp_BT - tensors.ref_logp_BT) * mask).sum() / n)
        return out

    def _dump(self, step: int, rollouts: RolloutBatch, rewards, tensors) -> None:
        if not self.cfg.trainer.dump_rollouts:
            return
        mask = tensors.batch.mask_BT
        per_traj = ((tensors.adv_BT * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
        dump_rollouts(self.path / "rollouts" / f"step_{step:06d}.jsonl", step, rollouts, rewards, self.tokenizer,
                      per_traj)


__all__ = ["RLTrainer", "rollout_seed", "run_local", "step_batch", "step_counts"]
