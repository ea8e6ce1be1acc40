"""Outages are not the policy's fault: trajectories touched by a tool infrastructure failure carry no loss, are out
of their group's statistics (soft and hard attribution, entropy scaling), are counted per step, raise the
infra_failures alarm, and are handled the same way on the verl engine's path (tree outputs, advantages, reward
extras). The real RL step with a failing provider: tests/integration/test_rl_outage.py."""

from __future__ import annotations

import pytest
import torch

from stages.agent.rewards import Reward
from stages.core.config.rl import AdvantageSection, AlarmSection, RLSection
from stages.generation.rollout_state import LiveTrajectory, trajectory_metrics
from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory
from stages.rl.advantages import compute_advantages, exclude_rows, owner_matrix
from stages.rl.alarms import AlarmStop, AlarmWatch, detect_alarms
from stages.rl.step_metrics import rollout_metrics
from stages.rl.update import ppo_update
from stages.rl.verl.advantage import check_infra_share, kept_rows, tree_advantages
from stages.rl.verl.reward import compute_score
from stages.rl.verl.tree import tree_outputs
from tests.unit.test_rl_algos_update import _grads_after, _step_tensors, tiny_llama  # noqa: F401 (fixture)

torch.set_num_threads(1)
EPS = 1e-6


def test_excluded_rows_leave_the_group_statistics():
    # group 0 = rows 0..3 with rewards [1, 0, 0.5, 1]; row 3 hit a provider failure. Over the kept rows
    # [1, 0, 0.5]: mean 0.5, unbiased std sqrt(((.5)^2 + (.5)^2 + 0) / 2) = 0.5, so A = [.5, -.5, 0] / (0.5 + eps);
    # the dropped row gets 0. Group 1 (rows 4, 5: rewards 0 and 1): mean .5, std 0.7071, A = -/+ .5/(0.7071 + eps).
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 3)
    keep = torch.tensor([True, True, True, False, True, True])
    adv = compute_advantages(AdvantageSection(), rewards, group, mask, keep_B=keep)
    half = 0.5 / (0.5 + EPS)
    root2 = 0.5 / (2 ** -0.5 + EPS)
    expected = torch.tensor([half, -half, 0.0, 0.0, -root2, root2]).unsqueeze(1).expand(6, 3)
    assert torch.allclose(adv, expected, atol=1e-5)
    # without the exclusion the outage-hit reward 1 would shift the group: row 2 would get a negative advantage
    assert compute_advantages(AdvantageSection(), rewards, group, mask)[2, 0] < 0
    regrouped, masked = exclude_rows(group, mask, keep)
    assert regrouped.tolist() == [0, 0, 0, 2, 1, 1] and masked[3].sum() == 0 and masked[:3].sum() == 9


def test_hard_attribution_and_entropy_scaling_ignore_excluded_rows():
    # row 0 = root P, rows 1 and 2 = branches A, B forked from P at token 2 (tokens 0, 1 shared by all three).
    # P hit a provider failure after the fork (dropped); A and B are kept with rewards 1 and 0: mean .5, std 0.7071,
    # A = +.5/(0.7071+eps), B = -A. Shared tokens 0, 1 get the mean over the kept sharers (A, B) = 0; after the
    # fork each keeps its own.
    rewards = torch.tensor([5.0, 1.0, 0.0])
    group = torch.zeros(3, dtype=torch.long)
    mask = torch.ones(3, 4)
    owner = owner_matrix([None, 0, 0], [0, 2, 2], 4)
    keep = torch.tensor([False, True, True])
    adv = compute_advantages(AdvantageSection(attribution="hard"), rewards, group, mask, owner, keep_B=keep)
    a = 0.5 / (2 ** -0.5 + EPS)
    assert torch.allclose(adv, torch.tensor([[0, 0, 0, 0], [0, 0, a, a], [0, 0, -a, -a]]), atol=1e-5)
    # entropy-aware scaling standardises over kept tokens only: a huge entropy on the dropped row changes nothing
    entropy = torch.tensor([[100.0] * 4, [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    cfg = AdvantageSection(attribution="hard", entropy_aware=True)
    scaled = compute_advantages(cfg, rewards, group, mask, owner, entropy, keep)
    calm = entropy.clone()
    calm[0] = 0.25
    assert torch.allclose(scaled, compute_advantages(cfg, rewards, group, mask, owner, calm, keep), atol=1e-6)


def test_the_update_trains_on_kept_rows_only(tiny_llama):  # noqa: F811 (fixture)
    # rows 0..3 (groups 0, 0, 1, 1); row 1 is masked: the gradient equals that of the batch without it, for the
    # aggregation where a row without tokens would still count in the denominator (seq_mean_token_mean)
    cfg = RLSection(loss={"aggregation": "seq_mean_token_mean"}, optim={"grad_clip": 1e9},
                    rollout={"n": 2, "initial_rollouts": 2, "max_response_length": 8},
                    trainer={"ppo_mini_batch_size": 2, "micro_batch_size": 1})
    data = _step_tensors()
    data.keep_B = torch.tensor([True, False, True, True])
    data.batch.mask_BT[1] = 0
    kept = _step_tensors().select(torch.tensor([0, 2, 3]))
    with_mask, without = _grads_after(tiny_llama, cfg, data), _grads_after(tiny_llama, cfg, kept)
    for name in with_mask:
        assert torch.allclose(with_mask[name], without[name], atol=1e-7, rtol=1e-5), name
    # every row masked: no optimizer step at all (not even weight decay)
    data.keep_B = torch.zeros(4, dtype=torch.bool)
    opt = torch.optim.AdamW(tiny_llama.parameters(), lr=1.0)
    before = [p.detach().clone() for p in tiny_llama.parameters()]
    out = ppo_update(cfg, tiny_llama, opt, data, group_size=2, device=torch.device("cpu"))
    assert out["optimizer_steps"] == 0.0 and all(torch.equal(a, p) for a, p in zip(before, tiny_llama.parameters()))


def _traj(i: int, group: int, infra: int = 0, **kw) -> Trajectory:
    return Trajectory(traj_id=i, group=group, prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 0],
                      infra_failures=infra, tool_calls={"search": 1}, **kw)


def test_a_branch_inherits_its_parents_failures_and_counts_are_per_step():
    parent = LiveTrajectory(_traj(0, 0, infra=1), key=0, state=None)
    child = parent.fork(1, 1, fork_at=2, state=None)
    assert child.traj.infra_failures == 1 and child.traj.masked           # the failed result is in its prefix
    clean = LiveTrajectory(_traj(2, 0), key=2, state=None)
    from stages.generation.rollout_state import GroupState

    groups = [GroupState(item=None, n=3, initial=2, members=[parent, child, clean])]
    metrics = trajectory_metrics(groups)
    # one failed call (the branch's copy is not a second one), two trajectories touched
    assert metrics["infra_failures"] == 1.0 and metrics["masked_trajectories"] == 2.0
    assert metrics["search_calls_executed"] == 2.0                        # parent + clean; the copy inherited it
    batch = RolloutBatch([RolloutGroup(0, "q", "a", "qa", [parent.traj, child.traj, clean.traj], 2)], metrics)
    rewards = [Reward(0.0, False, "", None, 0.0)] * 3
    row = rollout_metrics(batch, rewards)
    assert row["tools/infra_failures"] == 1.0 and row["rollout/masked_trajectories"] == 2.0
    assert row["rollout/masked_share"] == pytest.approx(2 / 3)


def test_infra_alarm_warns_and_stops_on_request(tmp_path):
    row = {"step": 1, "rollout/masked_share": 0.25, "rollout/masked_trajectories": 2.0, "rollout/trajectories": 8.0,
           "tools/infra_failures": 3.0}
    assert [a.name for a in detect_alarms([row], AlarmSection(infra_share=0.25))] == ["infra_failures"]
    assert detect_alarms([row], AlarmSection(infra_share=0.3)) == []
    assert detect_alarms([{**row, "rollout/masked_share": 0.0}], AlarmSection(infra_share=0.0)) == []
    watch = AlarmWatch(AlarmSection(infra_share=0.2, stop_on=("infra_failures",)), tmp_path / "alarms.jsonl")
    with pytest.raises(AlarmStop, match="2 of 8 trajectories"):
        watch.check([dict(row)])


def test_verl_tree_outputs_zero_the_mask_and_advantages_leave_them_out():
    trajs = [_traj(0, 0), _traj(1, 0, infra=1), _traj(2, 0, infra=1, parent_id=1, fork_at=1, kind="branch",
                                                     meta={"inherited_infra_failures": 1})]
    batch = RolloutBatch([RolloutGroup(0, "q", "a", "qa", trajs, 2, branches=1)])
    fields = tree_outputs(batch)
    assert [f["response_mask"] for f in fields] == [[1, 0], [0, 0], [0, 0]]
    assert [f["extra_fields"]["arpo_masked"] for f in fields] == [0, 1, 1]
    assert [f["extra_fields"]["arpo_infra_failures"] for f in fields] == [0, 1, 0]  # the copy is not counted
    # verl's reward manager passes extra_fields in extra_info: the extras become per-step verl metrics
    extras = compute_score("src", "no format", "42", {"ability": "qa", **fields[1]["extra_fields"]})
    assert (extras["infra_failures"], extras["masked"]) == (1.0, 1.0)
    # rows u0 (kept, reward 1), u1 (masked, reward 1), u2 (kept, reward 0): kept rows +-.5/(0.7071+eps)
    mask = torch.tensor([f["response_mask"] + [0] for f in fields], dtype=torch.float32)
    mask[0] = torch.tensor([1.0, 1.0, 0.0])
    mask[2] = torch.tensor([1.0, 1.0, 0.0])  # (verl's plain estimator path sees only the mask)
    rewards = torch.zeros(3, 3)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 0.0])
    want = compute_advantages(AdvantageSection(), rewards.sum(-1), torch.zeros(3, dtype=torch.long), mask,
                              keep_B=torch.tensor([True, False, True]))
    assert torch.allclose(tree_advantages(AdvantageSection(), rewards, mask, ["u"] * 3), want)
    extra = [f["extra_fields"] for f in fields]
    assert kept_rows(torch.ones(3, 3), extra).tolist() == [True, False, False]
    with pytest.raises(AlarmStop, match="infra_failures"):
        tree_advantages(AdvantageSection(), rewards, mask, ["u"] * 3,
                        alarms=AlarmSection(infra_share=0.3, stop_on=("infra_failures",)))
    assert check_infra_share(torch.tensor([True, True, True]), AlarmSection(infra_share=0.0)) is None
