"""Advantages (GRPO, hard attribution, AEPO entropy scaling): hand-derived values in the comments."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from stages.core.config.rl import AdvantageSection
from stages.core.registry import UnknownNameError
from stages.rl.advantages import (
    ADVANTAGES,
    compute_advantages,
    entropy_scaling,
    group_normalized,
    hard_attribution,
    owner_matrix,
)

torch.set_num_threads(1)
TOL = 1e-5  # float32 arithmetic on numbers of order 1; eps = 1e-6 shifts the results by < 2e-6


def test_group_normalized_hand_values():
    # group 0: R = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = 4*0.25/3 = 1/3, std = 0.577350
    #          A = +-0.5 / 0.577350 = +-0.866025
    # group 1: a lone trajectory -> A = 0 (no comparison, std of one sample taken as 0)
    # group 2: R = [3, 3] -> std 0 -> A = 0 / (0 + eps) = 0
    # group 3: R = [-1, 0.5, 1.1]: mean 0.2, dev [-1.2, 0.3, 0.9], var = (1.44+0.09+0.81)/2 = 1.17,
    #          std = 1.081665 -> A = [-1.109400, 0.277350, 0.832050]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 3.0, -1.0, 0.5, 1.1])
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2, 3, 3, 3])
    adv = group_normalized(rewards, groups, eps=1e-6)
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0, -1.109400, 0.277350, 0.832050]
    assert adv.tolist() == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("value,size", [(1.1, 16), (0.1, 12), (0.8, 16), (-1.0, 16), (1.1, 12), (0.1, 16),
                                        (0.3, 7), (1.0, 2)])
def test_all_equal_group_gets_exactly_zero(value, size):
    # R_i = v for all i: mean = v, every deviation R_i - mean = 0, std = 0 -> A = 0 / (0 + eps) = 0, exactly.
    # (float32 statistics gave |A| = 0.106 for 16 x 1.1 and 0.0147 for 12 x 0.1: the mean was one ulp off.)
    # The group sits next to another group, so the shifted statistics are per group, not batch-wide.
    rewards = torch.tensor([value] * size + [0.0, 1.0])
    groups = torch.tensor([5] * size + [9, 9])
    adv = group_normalized(rewards, groups, eps=1e-6)
    assert torch.equal(adv[:size], torch.zeros(size))
    # the other group R = [0, 1]: mean 0.5, var = 2 * 0.25 / 1 = 0.5, std = 0.707107 -> A = -+0.5 / 0.707108
    assert adv[size:].tolist() == pytest.approx([-0.707106, 0.707106], abs=1e-6)


def test_normal_groups_to_1e6():
    # group 0: R = [1.1, 0, -1, 1.1]: mean = 1.2 / 4 = 0.3, dev = [0.8, -0.3, -1.3, 0.8],
    #   sum dev^2 = 0.64 + 0.09 + 1.69 + 0.64 = 3.06, var = 3.06 / 3 = 1.02, std = 1.0099505
    #   A = dev / (1.0099505 + 1e-6) = [0.7921173, -0.2970440, -1.2871905, 0.7921173]
    # group 1: R = 11 x 0.1 and one 1.1: mean = 2.2 / 12 = 0.1833333, dev = -0.0833333 (x 11), 0.9166667,
    #   sum dev^2 = 11 / 144 + 121 / 144 = 132 / 144 = 0.9166667, var = 0.9166667 / 11 = 1/12, std = 0.2886751
    #   A = -0.0833333 / 0.2886761 = -0.2886741, 0.9166667 / 0.2886761 = 3.1754155
    rewards = torch.tensor([1.1, 0.0, -1.0, 1.1] + [0.1] * 11 + [1.1])
    groups = torch.tensor([0] * 4 + [1] * 12)
    adv = group_normalized(rewards, groups, eps=1e-6).tolist()
    assert adv[:4] == pytest.approx([0.7921173, -0.2970440, -1.2871905, 0.7921173], abs=1e-6)
    assert adv[4:15] == pytest.approx([-0.2886741] * 11, abs=1e-6)
    assert adv[15] == pytest.approx(3.1754155, abs=1e-6)


def test_group_normalized_loop_equivalence():
    gen = random.Random(0)
    rewards = [gen.choice([-1.0, 0.0, 0.3, 1.0, 1.1]) for _ in range(40)]
    groups = [gen.randrange(7) for _ in range(40)]
    fast = group_normalized(torch.tensor(rewards), torch.tensor(groups), eps=1e-6).tolist()
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rr for rr, gg in zip(rewards, groups) if gg == g]
        std = statistics.stdev(members) if len(members) > 1 else 0.0  # statistics.stdev is the unbiased one
        assert fast[i] == pytest.approx((r - statistics.fmean(members)) / (std + 1e-6), abs=1e-4)


def test_grpo_broadcasts_over_masked_tokens():
    # two trajectories of one group, R = [1, 0] -> A = +-0.5/0.707107 = +-0.707107; token 1 is a tool result
    cfg = AdvantageSection()
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    adv = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    a = 0.707107
    assert adv.tolist()[0] == pytest.approx([a, 0.0, a], abs=TOL)
    assert adv.tolist()[1] == pytest.approx([-a, -a, 0.0], abs=TOL)


def _tree():
    # row 0 root; row 1 forked from row 0 after 2 tokens; row 2 forked from row 1 after 4 tokens
    return [None, 0, 1], [0, 2, 4]


def test_owner_matrix_hand_values():
    # owner(i,t) = owner(parent(i),t) if t < fork_at(i) else i
    # row 1: t<2 -> owner(0,t)=0, else 1         -> [0,0,1,1,1,1]
    # row 2: t<4 -> owner(1,t) = [0,0,1,1], else 2 -> [0,0,1,1,2,2]
    parents, forks = _tree()
    assert owner_matrix(parents, forks, 6).tolist() == [[0] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2]]


def test_owner_matrix_rejects_parent_after_child():
    with pytest.raises(ValueError, match="creation order"):
        owner_matrix([1, None], [1, 0], 3)


def test_hard_attribution_hand_values():
    # A = [1.0, -0.5, 2.0]; row 0 has 5 tokens (t=5 padding); token 3 of rows 1 and 2 is a tool result (mask 0)
    # t=0,1: all three rows share row 0's tokens      -> (1 - 0.5 + 2)/3 = 0.833333
    # t=2:   rows 1,2 share row 1's token -> (-0.5+2)/2 = 0.75; row 0 alone -> 1.0
    # t=3:   rows 1,2 masked -> 0; row 0 -> 1.0
    # t=4:   each row owns its token -> 1.0, -0.5, 2.0;  t=5: row 0 padding -> 0, -0.5, 2.0
    parents, forks = _tree()
    owner = owner_matrix(parents, forks, 6)
    mask = torch.ones(3, 6)
    mask[0, 5] = 0
    mask[1, 3] = mask[2, 3] = 0
    adv = hard_attribution(torch.tensor([1.0, -0.5, 2.0]), owner, mask)
    m = 2.5 / 3
    assert adv[0].tolist() == pytest.approx([m, m, 1.0, 1.0, 1.0, 0.0], abs=TOL)
    assert adv[1].tolist() == pytest.approx([m, m, 0.75, 0.0, -0.5, -0.5], abs=TOL)
    assert adv[2].tolist() == pytest.approx([m, m, 0.75, 0.0, 2.0, 2.0], abs=TOL)


def _random_forest(gen: random.Random, rows: int, length: int) -> tuple[list[int | None], list[int]]:
    parents: list[int | None] = []
    forks = []
    for i in range(rows):
        if i == 0 or gen.random() < 0.3:
            parents.append(None)
            forks.append(0)
        else:
            parents.append(gen.randrange(i))
            forks.append(gen.randrange(length + 1))
    return parents, forks


def test_owner_and_hard_attribution_loop_equivalence():
    gen = random.Random(1)
    rows, length = 12, 9
    parents, forks = _random_forest(gen, rows, length)

    def owner(i: int, t: int) -> int:  # the recursive definition, read literally
        return owner(parents[i], t) if parents[i] is not None and t < forks[i] else i

    fast_owner = owner_matrix(parents, forks, length)
    assert fast_owner.tolist() == [[owner(i, t) for t in range(length)] for i in range(rows)]
    adv = torch.tensor([gen.uniform(-2, 2) for _ in range(rows)])
    mask = torch.tensor([[float(gen.random() < 0.8) for _ in range(length)] for _ in range(rows)])
    fast = hard_attribution(adv, fast_owner, mask)
    for i in range(rows):
        for t in range(length):
            sharing = [j for j in range(rows) if owner(j, t) == owner(i, t) and mask[j, t] != 0]
            expected = sum(adv[j].item() for j in sharing) / len(sharing) if mask[i, t] != 0 else 0.0
            assert fast[i, t].item() == pytest.approx(expected, abs=1e-5)


def test_soft_attribution_keeps_each_copy_its_own_advantage():
    # same tree, rewards [1, 0, 0] in one group: mean 1/3, dev [2/3, -1/3, -1/3], var = (4/9+1/9+1/9)/2 = 1/3,
    # std 0.577350 -> A = [1.154701, -0.577350, -0.577350], on every valid token, shared or not
    parents, forks = _tree()
    mask = torch.ones(3, 6)
    cfg = AdvantageSection(attribution="soft")
    adv = compute_advantages(cfg, torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long), mask,
                             owner_matrix(parents, forks, 6))
    for row, a in zip(adv.tolist(), [1.154701, -0.577350, -0.577350]):
        assert row == pytest.approx([a] * 6, abs=TOL)
    hard = compute_advantages(AdvantageSection(attribution="hard"), torch.tensor([1.0, 0.0, 0.0]),
                              torch.zeros(3, dtype=torch.long), mask, owner_matrix(parents, forks, 6))
    # t=0: shared by all three -> mean of the advantages = 0 (they sum to 0 within the group)
    assert hard[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=TOL)


def test_entropy_scaling_hand_values():
    # valid entropies [0.1, 0.3, 0.5] (the 9.0 is masked): mean 0.3, unbiased std 0.2 -> H_std = [-1, 0, 1]
    # factor = 1 + 0.2 * H_std = [0.8, 1.0, 1.2]; masked tokens keep factor 1
    entropy = torch.tensor([[0.1, 0.3, 9.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    factor = entropy_scaling(entropy, mask, alpha=0.2)
    assert factor.tolist()[0] == pytest.approx([0.8, 1.0, 1.0], abs=TOL)
    assert factor.tolist()[1] == pytest.approx([1.2, 1.0, 1.0], abs=TOL)


def test_entropy_scaling_constant_entropy_uses_unit_sigma():
    # all valid entropies equal -> sigma := 1, H_std = 0 -> factor 1 everywhere
    factor = entropy_scaling(torch.full((2, 3), 0.4), torch.ones(2, 3), alpha=0.2)
    assert factor.tolist() == [[1.0] * 3] * 2


def test_entropy_aware_grpo_and_stop_gradient():
    # R = [1, 0] -> A = [0.707107, -0.707107]; entropies [0.1, 0.3 | 0.5, 0.3]: mean 0.3, std
    # sqrt((0.04+0+0.04+0)/3) = 0.163299 -> H_std = [-1.224745, 0, 1.224745, 0]
    # factors [0.755051, 1, 1.244949, 1] -> A' = [0.533902, 0.707107 | -0.880312, -0.707107]
    entropy = torch.tensor([[0.1, 0.3], [0.5, 0.3]], requires_grad=True)
    cfg = AdvantageSection(entropy_aware=True, entropy_alpha=0.2)
    adv = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 2),
                             entropy_BT=entropy)
    assert adv.tolist()[0] == pytest.approx([0.533902, 0.707107], abs=TOL)
    assert adv.tolist()[1] == pytest.approx([-0.880312, -0.707107], abs=TOL)
    assert not adv.requires_grad  # sg(H): no gradient flows into the entropy


def test_missing_inputs_and_unknown_names_fail_with_the_fix():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="attribution=soft"):
        compute_advantages(AdvantageSection(attribution="hard"), torch.zeros(2), torch.zeros(2, dtype=torch.long),
                           mask)
    with pytest.raises(ValueError, match="entropy"):
        compute_advantages(AdvantageSection(entropy_aware=True), torch.zeros(2), torch.zeros(2, dtype=torch.long),
                           mask)
    with pytest.raises(UnknownNameError, match="grpo"):
        compute_advantages(AdvantageSection(estimator="grpoo"), torch.zeros(2), torch.zeros(2, dtype=torch.long),
                           mask)
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(AdvantageSection(), torch.tensor([math.nan, 0.0]), torch.zeros(2, dtype=torch.long), mask)
    assert "grpo" in ADVANTAGES
