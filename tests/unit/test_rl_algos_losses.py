"""Policy losses (dual-clip PPO, AEPO balanced clipping) with their gradients, aggregation modes, KL k1/k3.

Gradients are taken with respect to logp; d(-A r)/d logp = -A r because r = exp(logp - old_logp).
"""

from __future__ import annotations

import math

import pytest
import torch

from stages.core.config.rl import LossSection
from stages.core.registry import UnknownNameError
from stages.rl.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    aggregation_weights,
    kl_penalty,
    total_token_loss,
)

torch.set_num_threads(1)
TOL = 1e-5
CFG = LossSection()  # eps_low = eps_high = 0.2, c = 3

# token:         1     2     3     4     5     6     7
ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
RATIO = [1.1, 1.5, 0.5, 0.5, 1.5, 4.0, 4.0]


def _run(name: str, cfg: LossSection = CFG):
    old = torch.zeros(1, len(RATIO))
    logp = torch.tensor([[math.log(r) for r in RATIO]], requires_grad=True)
    loss, stats = POLICY_LOSSES.get(name)(logp, old, torch.tensor([ADV]), torch.ones(1, len(RATIO)), cfg)
    loss.sum().backward()
    return loss.detach()[0].tolist(), logp.grad[0].tolist(), stats


def test_ppo_dual_clip_values_and_gradient():
    # 1: A=1,  r=1.1: max(-1.1, -1.1) = -1.1 (inside the band)           grad -A r = -1.1
    # 2: A=1,  r=1.5: max(-1.5, -1.2) = -1.2 (clipped, constant)         grad 0
    # 3: A=1,  r=0.5: max(-0.5, -0.8) = -0.5 (unclipped)                 grad -0.5
    # 4: A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped); min(0.8, 3) = 0.8    grad 0
    # 5: A=-1, r=1.5: max(1.5, 1.2) = 1.5; min(1.5, 3) = 1.5              grad -A r = 1.5
    # 6: A=-1, r=4:   max(4, 1.2) = 4; dual clip min(4, 3) = 3 (constant) grad 0
    # 7: A=1,  r=4:   max(-4, -1.2) = -1.2 (clipped)                       grad 0
    loss, grad, stats = _run("ppo_dual_clip")
    assert loss == pytest.approx([-1.1, -1.2, -0.5, 0.8, 1.5, 3.0, -1.2], abs=TOL)
    assert grad == pytest.approx([-1.1, 0.0, -0.5, 0.0, 1.5, 0.0, 0.0], abs=TOL)
    # clipped loss > unclipped on tokens 2, 4, 7 -> 3/7; dual clip binds on token 6 -> 1/7
    assert stats["clip_fraction"] == pytest.approx(3 / 7, abs=TOL)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 7, abs=TOL)
    # ppo_kl = mean(old - logp) = -mean(log r) = -(ln1.1+ln1.5+ln.5+ln.5+ln1.5+ln4+ln4)/7 = -0.395906
    assert stats["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIO) / 7, abs=TOL)


def test_aepo_balanced_clip_keeps_gradient_above_bound_zero_below():
    # same forward values as dual-clip PPO (the upper bound's value is 1 + eps_high = 1.2)
    # 2: A=1, r=1.5 > 1.2: -A * 1.2 r/sg(r) -> grad -A * 1.2 = -1.2 (kept, rescaled by 1.2/r vs -A r = -1.5)
    # 7: A=1, r=4   > 1.2: grad -1.2 (PPO gives 0)
    # 4: A=-1, r=0.5 < 0.8: lower bound is the constant 0.8 -> grad 0 (zero below)
    # 5: A=-1, r=1.5: unclipped 1.5 wins the max -> grad 1.5 as in PPO;  6: dual clip constant -> 0
    loss, grad, stats = _run("aepo_balanced_clip")
    assert loss == pytest.approx([-1.1, -1.2, -0.5, 0.8, 1.5, 3.0, -1.2], abs=TOL)
    assert grad == pytest.approx([-1.1, -1.2, -0.5, 0.0, 1.5, 0.0, -1.2], abs=TOL)
    assert stats["clip_fraction"] == pytest.approx(3 / 7, abs=TOL)


def test_asymmetric_clip_bounds():
    # eps_low 0.1, eps_high 0.3 (clip-higher): token 2 (A=1, r=1.5): max(-1.5, -1.3) = -1.3;
    # token 3 (A=1, r=0.5): max(-0.5, -0.9) = -0.5; token 4 (A=-1, r=0.5): max(0.5, 0.9) = 0.9
    loss, _, _ = _run("ppo_dual_clip", LossSection(clip_ratio_low=0.1, clip_ratio_high=0.3))
    assert loss[1:4] == pytest.approx([-1.3, -0.5, 0.9], abs=TOL)


def test_loss_is_zero_with_zero_gradient_on_tool_tokens():
    # tokens with mask 0 (tool results, padding) contribute neither loss nor gradient, whatever A and r are
    logp = torch.tensor([[0.1, -2.0, 0.3]], requires_grad=True)  # r_0 = 1.105: inside the band
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    for name in POLICY_LOSSES:
        logp.grad = None
        loss, _ = POLICY_LOSSES.get(name)(logp, torch.zeros(1, 3), torch.tensor([[1.0, 5.0, -5.0]]), mask, CFG)
        loss.sum().backward()
        assert loss[0, 1:].tolist() == [0.0, 0.0]
        assert logp.grad[0, 1:].tolist() == [0.0, 0.0]
        assert logp.grad[0, 0].item() != 0.0


MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])


def test_aggregation_modes():
    # token_mean: (1+2+3+4)/4 = 2.5
    # seq_mean_token_mean: row means 6/3 = 2 and 4/1 = 4 -> (2+4)/2 = 3.0
    # seq_mean_token_sum_norm (L=4): row sums 6, 4 -> (6/4 + 4/4)/2 = 1.25
    assert aggregate(LOSS, MASK, "token_mean", 4).item() == pytest.approx(2.5, abs=TOL)
    assert aggregate(LOSS, MASK, "seq_mean_token_mean", 4).item() == pytest.approx(3.0, abs=TOL)
    assert aggregate(LOSS, MASK, "seq_mean_token_sum_norm", 4).item() == pytest.approx(1.25, abs=TOL)


def test_aggregation_weights_split_exactly_over_micro_batches():
    # gradient accumulation: the mini-batch weights summed over micro-batches give the mini-batch loss, also
    # when micro-batches have different numbers of valid tokens (a mean of micro-batch means would give
    # (2 + 4)/2 = 3 for token_mean instead of 2.5)
    for mode in AGGREGATIONS:
        weights = aggregation_weights(mode, MASK, 4)
        split = sum((LOSS[i:i + 1] * weights[i:i + 1]).sum() for i in range(2))
        assert split.item() == pytest.approx(aggregate(LOSS, MASK, mode, 4).item(), abs=TOL)


def test_aggregation_loop_equivalence():
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) < 0.6).float()
    mask[2] = 0  # a row with no valid tokens
    rows = [[loss[b, t].item() for t in range(7) if mask[b, t]] for b in range(5)]
    tokens = [x for row in rows for x in row]
    assert aggregate(loss, mask, "token_mean", 7).item() == pytest.approx(sum(tokens) / len(tokens), abs=TOL)
    seq_means = [sum(r) / len(r) if r else 0.0 for r in rows]
    assert aggregate(loss, mask, "seq_mean_token_mean", 7).item() == pytest.approx(sum(seq_means) / 5, abs=TOL)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", 10).item() == \
        pytest.approx(sum(sum(r) / 10 for r in rows) / 5, abs=TOL)


def test_micro_token_mean_is_the_references_weighting():
    # reference (verl 0.3 fork dp_actor.py): each micro-batch's token mean x (rows in it / rows in the mini-batch)
    # micro-batches of 1 row: row 0 has 3 tokens, row 1 has 1; M = 2
    #   row 0: (1+2+3)/3 * 1/2 = 1.0; row 1: 4/1 * 1/2 = 2.0 -> 3.0 (token_mean: 2.5)
    assert aggregate(LOSS, MASK, "micro_token_mean", 4, micro_rows=1).item() == pytest.approx(3.0, abs=TOL)
    weights = aggregation_weights("micro_token_mean", MASK, 4, micro_rows=1)
    flat = aggregation_weights("token_mean", MASK, 4)
    # per-token factor against token_mean = mean length of the mini-batch (4/2 = 2) / that of the micro-batch
    assert (weights[0, 0] / flat[0, 0]).item() == pytest.approx(2 / 3, abs=TOL)
    assert (weights[1, 0] / flat[1, 0]).item() == pytest.approx(2 / 1, abs=TOL)
    # one micro-batch = the mini-batch: token_mean
    assert aggregate(LOSS, MASK, "micro_token_mean", 4, micro_rows=2).item() == pytest.approx(2.5, abs=TOL)
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) < 0.6).float()
    expected = sum((loss[s:s + 2] * mask[s:s + 2]).sum() / mask[s:s + 2].sum() * (mask[s:s + 2].shape[0] / 5)
                   for s in range(0, 5, 2))
    assert aggregate(loss, mask, "micro_token_mean", 7, micro_rows=2).item() == pytest.approx(expected.item(),
                                                                                           abs=TOL)
    with pytest.raises(ValueError, match="micro_batch_size"):
        AGGREGATIONS.get("micro_token_mean")(MASK, 4, 0)


def test_kl_k3_is_clamped_as_low_var_kl():
    # x = ref - logp = 3: e^3 - 3 - 1 = 16.0855 -> clamped to 10 (verl low_var_kl), so its gradient is 0;
    # x = 2: e^2 - 2 - 1 = 4.389056 stays, with gradient d/dlogp (e^x - x - 1) = -(e^x - 1) = -6.389056
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[3.0, 2.0]])
    kl = kl_penalty(logp, ref, "k3")
    assert kl[0].tolist() == pytest.approx([10.0, 4.389056], abs=TOL)
    kl.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -6.389056], abs=TOL)


def test_kl_k1_k3():
    # logp = ln 0.5, ref = ln 0.25: k1 = ln 2 = 0.693147;
    # k3: x = ref - logp = -ln 2 -> e^x - x - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.693147, abs=TOL)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.193147, abs=TOL)
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1 or k3"):
        kl_penalty(logp, ref, "k2")


def test_total_loss_adds_kl_and_entropy_terms():
    # token inside the band: A = 1, r = 1 -> pg = -1; k3 with ref = logp - ln 2: x = -ln2 -> 0.193147
    # total = -1 + 0.5 * 0.193147 - 0.1 * 2.0 = -1.103427
    cfg = LossSection(kl_coef=0.5, kl_type="k3", entropy_coef=0.1)
    logp = torch.tensor([[math.log(0.5)]])
    loss, stats = total_token_loss(cfg, logp, logp.clone(), torch.tensor([[1.0]]), torch.ones(1, 1),
                                   ref_logp_BT=logp - math.log(2), entropy_BT=torch.tensor([[2.0]]))
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 0.193147 - 0.2, abs=TOL)
    assert stats["kl"] == pytest.approx(0.193147, abs=TOL)
    with pytest.raises(ValueError, match="reference"):
        total_token_loss(cfg, logp, logp, torch.tensor([[1.0]]), torch.ones(1, 1))


def test_unknown_loss_and_aggregation_name_the_known_ones():
    with pytest.raises(UnknownNameError, match="ppo_dual_clip"):
        POLICY_LOSSES.get("ppo_dualclip")
    with pytest.raises(UnknownNameError, match="token_mean"):
        AGGREGATIONS.get("token-mean")
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(LOSS, MASK, "seq_mean_token_sum_norm", 0)
