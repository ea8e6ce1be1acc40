"""Chunked full-vocabulary log-probs and entropy (stages/rl/logprobs.py `ChunkedLogprobs`): the same values and
gradients as the unchunked formula, without a tokens x vocabulary float32 copy."""

from __future__ import annotations

import math

import pytest
import torch

from stages.rl import logprobs as lp

torch.set_num_threads(1)


def test_hand_checked_values():
    # one position, V = 2, logits [0, ln 3]: p = [1/4, 3/4]; log p(target 1) = ln 0.75 = -0.287682;
    # H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335 nats, / ln 2 = 0.811278
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    logp, entropy = lp.token_logprobs(logits, torch.tensor([[1]]), True)
    assert logp.item() == pytest.approx(-0.287682, abs=1e-6)
    assert entropy.item() == pytest.approx(0.811278, abs=1e-6)
    # uniform over V = 4: log p = -ln 4 and H / ln 4 = 1
    logp, entropy = lp.token_logprobs(torch.zeros(1, 1, 4), torch.tensor([[2]]), True)
    assert logp.item() == pytest.approx(-math.log(4), abs=1e-6) and entropy.item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 1024])      # 2 rows x 7 positions: chunks of 1, 1 (3 // 2), all 7
def test_chunked_equals_unchunked_with_gradients(monkeypatch, chunk):
    monkeypatch.setattr(lp, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 7, 11, generator=gen, dtype=torch.float64).float() * 3
    targets = torch.randint(0, 11, (2, 7), generator=gen)
    w_logp, w_ent = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)

    def run(fn):
        x = base.clone().requires_grad_(True)
        logp, ent = fn(x, targets, True)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        return logp.detach(), ent.detach(), x.grad

    ref, got = run(lp._token_logprobs), run(lp.token_logprobs)
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, atol=1e-5, rtol=1e-5)
    # without entropy the gradient is that of log p alone
    x = base.clone().requires_grad_(True)
    logp, ent = lp.token_logprobs(x, targets, False)
    assert ent is None
    (logp * w_logp).sum().backward()
    y = base.clone().requires_grad_(True)
    (lp._token_logprobs(y, targets, False)[0] * w_logp).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-6)


def test_bfloat16_logits_and_a_non_contiguous_slice(monkeypatch):
    monkeypatch.setattr(lp, "CHUNK", 4)
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(3, 9, 13, generator=gen).to(torch.bfloat16)
    logits = full[:, :8]                                  # as policy_forward slices the model's T + 1 columns
    targets = torch.randint(0, 13, (3, 8), generator=gen)
    ref = lp._token_logprobs(logits, targets, True)
    got = lp.token_logprobs(logits, targets, True)
    assert got[0].dtype == torch.float32
    assert torch.allclose(ref[0], got[0], atol=1e-5) and torch.allclose(ref[1], got[1], atol=1e-5)
    x = logits.detach().clone().requires_grad_(True)
    lp.token_logprobs(x, targets, True)[0].sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
