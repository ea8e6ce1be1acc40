"""Registrations seen by a fresh interpreter; our losses and estimator inside verl equal our registries."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from stages.core.config.rl import AdvantageSection, LossSection
from stages.rl.advantages import compute_advantages
from stages.rl.losses import POLICY_LOSSES, aggregate
from stages.rl.verl.launch import VerlPluginError, plugin_env, verify_plugin

pytestmark = pytest.mark.verl


def _preflight(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "stages.rl.verl.preflight"], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bare_import_verl_sees_every_registration_via_the_entry_point():
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    report = _preflight(env)
    assert report["ok"] and all(report["found"].values()), report
    assert set(report["found"]) == {"adv:arpo_grpo", "agent_loop:arpo_tree", "trainer:arpo_sync",
                                    "loss:arpo_ppo_dual_clip", "loss:arpo_aepo_balanced_clip"}


def test_external_modules_variable_alone_loads_the_plugin_and_the_launcher_check_passes():
    env = {**plugin_env(), "VERL_USE_EXTERNAL_PLUGINS": "none"}  # entry points off: only the variable
    assert all(verify_plugin(sys.executable, env).values())


def test_a_plugin_verl_cannot_see_fails_the_launcher_check_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    with pytest.raises(VerlPluginError, match="does not see .*arpo_grpo.*entry point"):
        verify_plugin(sys.executable, env)


def _actor_config(low=0.2, high=0.28, c=3.0, agg="token-mean"):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from tests.verl.conftest import compose_verl

    cfg = compose_verl([f"actor_rollout_ref.actor.clip_ratio_low={low}", f"actor_rollout_ref.actor.clip_ratio_high={high}",
                        f"actor_rollout_ref.actor.clip_ratio_c={c}", f"actor_rollout_ref.actor.loss_agg_mode={agg}",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=1",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    actor = omega_conf_to_dataclass(OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref.actor,
                                                                            resolve=False)))
    return actor


@pytest.mark.parametrize("ours", ["ppo_dual_clip", "aepo_balanced_clip"])
def test_registered_losses_equal_our_registry(ours):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import stages.rl.verl.plugin  # noqa: F401

    torch.manual_seed(0)
    B, T = 4, 9
    old = torch.randn(B, T) * 0.3 - 2
    logp = (old + torch.randn(B, T) * 0.4).requires_grad_(True)
    adv = torch.randn(B, T)
    mask = (torch.rand(B, T) > 0.25).float()
    config = _actor_config()
    verl_loss, metrics = get_policy_loss_fn(f"arpo_{ours}")(old, logp, adv, mask, "token-mean", config, None)
    section = LossSection(policy_loss=ours, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    loss_BT, stats = POLICY_LOSSES.get(ours)(logp, old, adv, mask, section)
    expected = aggregate(loss_BT, mask, "token_mean", T)
    assert torch.allclose(verl_loss, expected, atol=1e-6)
    g_verl, = torch.autograd.grad(verl_loss, logp, retain_graph=True)
    g_ours, = torch.autograd.grad(expected, logp)
    assert torch.allclose(g_verl, g_ours, atol=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(stats["clip_fraction"], abs=1e-6)
    if ours == "ppo_dual_clip":  # dual-clip PPO is verl's own `vanilla` loss: same value and gradient
        vanilla, _ = get_policy_loss_fn("vanilla")(old, logp, adv, mask, "token-mean", config, None)
        assert torch.allclose(vanilla, verl_loss, atol=1e-6)


def test_aepo_loss_keeps_gradient_above_the_clip_bound_inside_verl():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import stages.rl.verl.plugin  # noqa: F401

    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), 0.5, requires_grad=True)  # r = e^0.5 = 1.65 > 1 + 0.28
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    config = _actor_config()
    for name, nonzero in (("arpo_ppo_dual_clip", False), ("arpo_aepo_balanced_clip", True)):
        loss, _ = get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", config, None)
        grad, = torch.autograd.grad(loss, logp)
        # AEPO: d/dlogp of -A (1+eps) r / sg(r) = -(1.28) at A = 1; PPO: clipped, zero gradient
        assert grad.item() == (pytest.approx(-1.28, abs=1e-6) if nonzero else 0.0)


def test_estimator_through_verls_compute_advantage_equals_ours(settings_file):
    import numpy as np
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    import stages.rl.verl.plugin  # noqa: F401

    settings_file()
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, -1.0, 2.0])
    uids = np.array(["a", "a", "a", "a", "b", "c"], dtype=object)  # c: a group of one -> 0 (our semantics)
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]).float()
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(6), mask.sum(1).long() - 1] = scores
    data = DataProto(batch=TensorDict({"token_level_rewards": rewards, "response_mask": mask}, batch_size=6),
                     non_tensor_batch={"uid": uids})
    out = compute_advantage(data, adv_estimator="arpo_grpo", config=None)
    expected = compute_advantages(AdvantageSection(), scores, torch.tensor([0, 0, 0, 0, 1, 2]), mask)
    assert torch.allclose(out.batch["advantages"], expected, atol=1e-6)
    assert torch.all(out.batch["advantages"][5] == 0)


def test_an_outage_hit_row_leaves_its_group_inside_verl(settings_file):
    """A trajectory touched by a tool infrastructure failure reaches verl with an all-zero response mask
    (stages.rl.verl.tree.tree_outputs): verl's own compute_advantage through our estimator gives it 0 and the rest
    of its group the GRPO advantage over the kept rewards alone."""
    import numpy as np
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    import stages.rl.verl.plugin  # noqa: F401

    settings_file()
    # group a: rewards [1, 0, 1]; row 2 hit the outage. Kept [1, 0]: mean .5, std .7071 -> +-.5/(.7071 + 1e-6)
    scores = torch.tensor([1.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).float()
    rewards = torch.zeros_like(mask)
    rewards[:, 0] = scores
    data = DataProto(batch=TensorDict({"token_level_rewards": rewards, "response_mask": mask}, batch_size=3),
                     non_tensor_batch={"uid": np.array(["a", "a", "a"], dtype=object)})
    out = compute_advantage(data, adv_estimator="arpo_grpo", config=None)
    a = 0.5 / (2 ** -0.5 + 1e-6)
    assert torch.allclose(out.batch["advantages"], torch.tensor([[a, a, 0], [-a, 0, 0], [0, 0, 0]]), atol=1e-5)
