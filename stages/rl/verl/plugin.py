"""Our algorithm in verl's registries. Imported on every `import verl` (entry point group `verl.plugins`, and
VERL_USE_EXTERNAL_MODULES=stages.rl.verl.plugin in Ray's runtime env), so every Ray process sees:

- advantage estimator `arpo_grpo` -> stages.rl.advantages (GRPO group norm, our semantics: a group of one gets 0);
- policy losses `arpo_ppo_dual_clip`, `arpo_aepo_balanced_clip` -> stages.rl.losses per-token losses aggregated
  with verl's `agg_loss` (so micro-batches over data-parallel ranks sum to the global mean);
- agent loop `arpo_tree` and the worker/manager override (stages.rl.verl.agent_loop), once verl imports its v1
  trainer package in the process (stages.rl.verl.lazy: they import vLLM, which most verl processes never need);
- trainer mode `arpo_sync` (stages.rl.verl.trainer_mode, likewise), every verl run: verl's sync mode, our
  advantages over whole trees (any attribution, AEPO entropy-aware) and our rollout metrics;
- with ARPO_STACK_DIR set (the launcher sets it): a faulthandler stack dump on SIGUSR2 (stages.rl.verl.watchdog);
- with ARPO_VERL_ENTROPY=topk: our vLLM server replica returning top-k entropies (stages.rl.verl.topk_server).

verl swallows plugin import errors (logged at DEBUG), so the launcher checks `registrations()` in a fresh
interpreter before starting Ray (stages.rl.verl.launch.verify_plugin).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_adv_est, register_policy_loss

from stages.core.config.rl import LossSection
from stages.rl.losses import POLICY_LOSSES
from stages.rl.verl.advantage import tree_advantages
from stages.rl.verl.lazy import after_import
from stages.rl.verl.mapping import (
    ADV_ESTIMATOR,
    MANAGER_CLASS,
    TRAINER_MODE,
    TREE_AGENT,
)
from stages.rl.verl.mapping import POLICY_LOSSES as VERL_NAMES
from stages.rl.verl.settings import load_settings
from stages.rl.verl.watchdog import register_stack_dump

register_stack_dump()   # every process of a run: stacks on SIGUSR2 for the launcher's stall watchdog


@register_adv_est(ADV_ESTIMATOR)
def arpo_grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None,
              index: Any = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator signature over our registry (soft attribution; hard / entropy-aware run in arpo_sync)."""
    settings = load_settings()
    cfg = settings.advantage
    if cfg.attribution == "hard" or cfg.entropy_aware:
        raise ValueError("rl.advantage.attribution=hard / entropy_aware=true need trainer.v1.trainer_mode="
                         f"{TRAINER_MODE} (the mapping sets it); verl's estimator call passes no tree or entropy")
    if index is None:
        raise ValueError("arpo_grpo needs the prompt uid per row (verl's `index`); none was given")
    adv = tree_advantages(cfg, token_level_rewards, response_mask, list(index), alarms=settings.alarms)
    return adv, adv


def _policy_loss(ours: str):
    def loss_fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        clip = config.clip_ratio
        cfg = LossSection(policy_loss=ours, clip_ratio_low=config.clip_ratio_low if config.clip_ratio_low is not None
                          else clip, clip_ratio_high=config.clip_ratio_high if config.clip_ratio_high is not None
                          else clip, clip_ratio_c=float(config.get("clip_ratio_c", 3.0)))
        loss_BT, stats = POLICY_LOSSES.get(ours)(log_prob, old_log_prob, advantages, response_mask, cfg)
        if rollout_is_weights is not None:
            loss_BT = loss_BT * rollout_is_weights
        loss = agg_loss(loss_mat=loss_BT, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                        **config.global_batch_info)
        return loss, {"actor/pg_clipfrac": stats["clip_fraction"], "actor/ppo_kl": stats["ppo_kl"],
                      "actor/pg_clipfrac_lower": stats["dual_clip_fraction"]}

    loss_fn.__name__ = loss_fn.__qualname__ = VERL_NAMES[ours]
    return loss_fn


for _ours, _name in VERL_NAMES.items():
    register_policy_loss(_name)(_policy_loss(_ours))

# the agent loop (arpo_tree, our worker/manager) and the trainer mode (arpo_sync) import verl modules that import
# vLLM: registered once verl has imported their packages in this process (stages.rl.verl.lazy)
# (one hook, on verl's v1 package: it imports verl's agent-loop package itself, and hooking that one instead would
# import our agent loop while v1 is half-initialised)
after_import("verl.trainer.ppo.v1", lambda _: [importlib.import_module(f"stages.rl.verl.{name}")
                                               for name in ("agent_loop", "trainer_mode")])

if os.environ.get("ARPO_VERL_ENTROPY") == "topk":
    from stages.rl.verl.topk_server import register_topk_replica

    register_topk_replica()


def registrations() -> dict[str, bool]:
    """Which of our names verl can see in this process (the launcher's pre-flight check)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.utils.import_utils import load_class_from_fqn

    found = {f"adv:{ADV_ESTIMATOR}": ADV_ESTIMATOR in ADV_ESTIMATOR_REGISTRY,
             f"agent_loop:{TREE_AGENT}": TREE_AGENT in _agent_loop_registry,
             f"trainer:{TRAINER_MODE}": TRAINER_MODE in TRAINER_REGISTRY,
             f"manager:{MANAGER_CLASS}": load_class_from_fqn(MANAGER_CLASS, "AgentLoopManager") is not None}
    found |= {f"loss:{name}": name in POLICY_LOSS_REGISTRY for name in VERL_NAMES.values()}
    return found
