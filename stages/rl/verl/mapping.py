"""Our resolved config -> verl hydra overrides for `python -m verl.trainer.main_ppo` (pure; table in docs/rl.md).

Everything verl does not model (the rollout tree, tools, branching, AEPO, advantage options, seeds) reaches our
plugin through the settings file (`stages.rl.verl.settings`), named by the ARPO_VERL_SETTINGS variable that this
mapping puts into Ray's runtime environment. Keys absent from verl's ppo_trainer.yaml carry a leading `+`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stages.core.config.rl import RLSection
from stages.rl.verl.cpu_mode import extra_overrides, plugin_modules

if TYPE_CHECKING:
    from stages.core.tracking import Handoff

AGG_MODES = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
             "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
KL_TYPES = {"k1": "kl", "k3": "low_var_kl"}
POLICY_LOSSES = {"ppo_dual_clip": "arpo_ppo_dual_clip", "aepo_balanced_clip": "arpo_aepo_balanced_clip"}
ADV_ESTIMATOR = "arpo_grpo"
TREE_AGENT = "arpo_tree"
TRAINER_MODE = "arpo_sync"
MANAGER_CLASS = "stages.rl.verl.agent_loop.ArpoAgentLoopManagerTQ"
PLUGIN_MODULE = "stages.rl.verl.plugin"
STRATEGY = "fsdp2"   # FSDP2 DTensor shards: the checkpoint layout stages.rl.fsdp_merge is tested on
REWARD_PATH = "pkg://stages.rl.verl.reward"
_PLAIN = re.compile(r"^[\w./:~+@-]+$")


@dataclass(frozen=True)
class VerlPaths:
    model: str            # HF folder of the starting policy
    train_file: str       # verl parquet written by the launcher
    val_file: str
    checkpoints: str      # trainer.default_local_dir (auto-resume looks here)
    settings: str         # plugin settings JSON
    agent_loops: str      # agent-loop YAML naming arpo_tree
    rollout_dump: str     # trainer.rollout_data_dir
    experiment: str = "arpo"


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    text = str(value)
    if isinstance(value, Quoted) or (isinstance(value, str) and not _PLAIN.match(text)):  # hydra's grammar
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def external_modules(plugin_modules: list[str]) -> str:
    """VERL_USE_EXTERNAL_MODULES: extra modules (e.g. a platform plugin, which must be registered before verl's
    first device query) first, then our plugin."""
    return ",".join([*plugin_modules, PLUGIN_MODULE])


def model_type_of(folder: str | Path) -> str | None:
    """config.json's model_type of an HF folder (the architecture family rl.verl.remove_padding: auto asks about);
    None when the folder has no readable config."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def logging_overrides(loggers: list[str], paths: VerlPaths, handoff: Handoff | None = None) -> dict[str, object]:
    """verl's trainer.logger: rl.verl.logger (the file logger is what the stage reads into metrics.jsonl) plus the
    tracking backend's own verl logger, pointed by `handoff` (stages.core.tracking: a run nested in the RL stage's,
    `<stage run>-verl`) at the pipeline's tracker through the variables verl's loggers read in the trainer's Ray
    workers (mlflow: MLFLOW_TRACKING_URI + MLFLOW_RUN_ID; wandb: WANDB_*; tensorboard: TENSORBOARD_DIR, all in
    verl/utils/tracking.py). Values are quoted: an id or a flag must reach Ray's env_vars as a string."""
    extra = [handoff.verl_logger] if handoff is not None and handoff.verl_logger else []
    out: dict[str, object] = {"trainer.logger": list(dict.fromkeys([*loggers, *extra])),
                              "trainer.project_name": handoff.project if extra else "arpo-pipeline",
                              "trainer.experiment_name": handoff.name if extra else paths.experiment}
    for key, value in sorted(handoff.env.items()) if extra else ():
        out[f"+ray_kwargs.ray_init.runtime_env.env_vars.{key}"] = Quoted(value)
    return out


class Quoted(str):
    """A string hydra must read as a string (`'20'`, not the int 20; `'false'`, not a bool)."""


def verl_overrides(rl: RLSection, dtype: str, seed: int, paths: VerlPaths, model_type: str | None = None,
                   handoff: Handoff | None = None) -> list[str]:
    """The complete override list (no defaults of verl's that matter are left implicit). `model_type`: the
    policy's config.json model_type, which decides rl.verl.remove_padding: auto under sdpa (None: off).
    `handoff`: the RL stage's tracker run for verl's own logger (logging_overrides)."""
    if rl.loss.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"rl.loss.policy_loss={rl.loss.policy_loss!r} has no verl registration; the verl engine "
                         f"supports {sorted(POLICY_LOSSES)}")
    ro, tr, loss, opt, vs = rl.rollout, rl.trainer, rl.loss, rl.optim, rl.verl
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    length = ro.max_prompt_length + ro.max_response_length
    o: dict[str, object] = {
        # data
        "data.train_files": paths.train_file, "data.val_files": paths.val_file,
        "data.train_batch_size": tr.train_batch_size, "data.max_prompt_length": ro.max_prompt_length,
        "data.max_response_length": ro.max_response_length, "data.seed": seed, "data.shuffle": True,
        "data.truncation": "left" if ro.prompt_overflow == "truncate_left" else "error",
        "data.filter_overlong_prompts": ro.prompt_overflow == "skip", "data.return_raw_chat": True,
        # model
        "actor_rollout_ref.model.path": paths.model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": tr.gradient_checkpointing,
        # verl defaults to flash_attention_2, which verl[vllm] does not install (pre-flight: resources.py);
        # remove-padding packs each micro-batch into one row: flash-attn's varlen kernel keeps the sequences apart,
        # and so does sdpa for the verified families (transformers' mask from packed position ids; rl_engine.py)
        "+actor_rollout_ref.model.override_config.attn_implementation": vs.attn_implementation,
        "actor_rollout_ref.model.use_remove_padding": vs.uses_remove_padding(model_type),
        # actor: batches (mini-batch in prompts; verl multiplies by n), loss, optimizer, FSDP
        f"{actor}.ppo_mini_batch_size": tr.ppo_mini_batch_size, f"{actor}.ppo_epochs": tr.ppo_epochs,
        f"{actor}.ppo_micro_batch_size_per_gpu": tr.micro_batch_size, f"{actor}.data_loader_seed": seed,
        f"{actor}.policy_loss.loss_mode": POLICY_LOSSES[loss.policy_loss],
        f"{actor}.clip_ratio_low": loss.clip_ratio_low, f"{actor}.clip_ratio_high": loss.clip_ratio_high,
        f"{actor}.clip_ratio_c": loss.clip_ratio_c, f"{actor}.loss_agg_mode": AGG_MODES[loss.aggregation],
        f"{actor}.loss_scale_factor": ro.max_response_length if loss.aggregation == "seq_mean_token_sum_norm"
        else None,
        f"{actor}.use_kl_loss": loss.kl_coef > 0, f"{actor}.kl_loss_coef": loss.kl_coef,
        f"{actor}.kl_loss_type": KL_TYPES[loss.kl_type], f"{actor}.entropy_coeff": loss.entropy_coef,
        f"{actor}.optim.lr": opt.lr, f"{actor}.optim.weight_decay": opt.weight_decay,
        f"{actor}.optim.clip_grad": opt.grad_clip, f"{actor}.optim.betas": list(opt.betas),
        f"{actor}.optim.lr_scheduler_type": "constant", f"{actor}.optim.lr_warmup_steps": 0,
        f"{actor}.strategy": STRATEGY, "actor_rollout_ref.ref.strategy": STRATEGY,  # the layout fsdp_merge reads
        f"{actor}.fsdp_config.param_offload": vs.param_offload,
        f"{actor}.fsdp_config.optimizer_offload": vs.optimizer_offload,
        f"{actor}.fsdp_config.dtype": dtype, f"{actor}.fsdp_config.model_dtype": "fp32",
        # the compute precision is FSDP's mixed-precision param dtype (verl: bf16 when unset; fsdp_config.dtype is
        # not read by the FSDP engine, transformer_impl.py:391-397); master weights stay fp32 (model_dtype)
        **{f"+{role}.fsdp_config.mixed_precision.{key}": value for role in (actor, "actor_rollout_ref.ref")
           for key, value in (("param_dtype", dtype), ("reduce_dtype", "float32"), ("buffer_dtype", "float32"))},
        # rollout: vLLM replicas, our tree agent loop through our worker/manager
        f"{rollout}.name": "vllm", f"{rollout}.mode": "async", f"{rollout}.n": ro.n,
        f"{rollout}.temperature": ro.temperature, f"{rollout}.top_p": ro.top_p, f"{rollout}.top_k": ro.top_k,
        f"{rollout}.max_model_len": length, f"{rollout}.dtype": dtype, f"{rollout}.seed": seed,
        f"{rollout}.tensor_model_parallel_size": vs.rollout_tensor_parallel,
        f"{rollout}.gpu_memory_utilization": vs.gpu_memory_utilization,
        f"{rollout}.calculate_log_probs": True, f"{rollout}.enable_prefix_caching": True,
        f"{rollout}.log_prob_micro_batch_size_per_gpu": tr.micro_batch_size,
        f"{rollout}.agent.num_workers": vs.agent_workers, f"{rollout}.agent.default_agent_loop": TREE_AGENT,
        f"{rollout}.agent.agent_loop_config_path": paths.agent_loops,
        f"+{rollout}.agent.agent_loop_manager_class": MANAGER_CLASS,
        f"{rollout}.val_kwargs.n": 1,
        # advantage and reward: ours
        "algorithm.adv_estimator": ADV_ESTIMATOR, "algorithm.use_kl_in_reward": False,
        "reward.custom_reward_function.path": REWARD_PATH, "reward.custom_reward_function.name": "compute_score",
        "+reward.custom_reward_function.reward_kwargs.reward": tr.reward, "reward.num_workers": vs.reward_workers,
        # trainer: size, steps, checkpoints (auto-resume from the newest global_step_*), logging
        "trainer.nnodes": vs.nnodes, "trainer.n_gpus_per_node": vs.n_gpus_per_node,
        "trainer.use_v1": True, "trainer.v1.trainer_mode": TRAINER_MODE,
        "trainer.total_epochs": tr.epochs, "trainer.total_training_steps": tr.total_steps,
        "trainer.save_freq": tr.save_every, "trainer.max_actor_ckpt_to_keep": tr.keep_checkpoints,
        "trainer.default_local_dir": paths.checkpoints, "trainer.resume_mode": "auto",
        "trainer.rollout_data_dir": paths.rollout_dump if tr.dump_rollouts else None,
        **logging_overrides(list(vs.logger), paths, handoff), "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "+ray_kwargs.ray_init.runtime_env.env_vars.ARPO_VERL_SETTINGS": paths.settings,
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES": external_modules(plugin_modules(vs)),
        # resources: TransferQueue reserves one Ray CPU per storage unit (pre-flight: resources.py)
        "ray_kwargs.ray_init.num_cpus": vs.ray_num_cpus if not vs.ray_address else None,
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": vs.storage_units,
        "+ray_kwargs.ray_init.runtime_env.env_vars.ARPO_VERL_ENTROPY": rl.rollout.entropy_quantity,
    }
    if vs.max_token_len_per_gpu:
        o |= {f"{actor}.use_dynamic_bsz": True, f"{actor}.ppo_max_token_len_per_gpu": vs.max_token_len_per_gpu,
              f"{rollout}.log_prob_max_token_len_per_gpu": 2 * vs.max_token_len_per_gpu}
    if loss.kl_coef > 0:
        o["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = tr.micro_batch_size
    if vs.ray_address:
        o["+ray_kwargs.ray_init.address"] = vs.ray_address
    return [f"{k}={_fmt(v)}" for k, v in o.items()] + extra_overrides(vs)
