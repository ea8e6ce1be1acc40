"""The branching entropy: one per-token quantity for every backend, and the summed window (hand values in comments)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stages.core.config.loader import ConfigError, load_config
from stages.core.config.rl import RolloutSection
from stages.core.registry import UnknownNameError
from stages.generation.base import SamplingSpec
from stages.generation.sampling import sample_tokens
from stages.generation.token_entropy import (
    TokenEntropy,
    view_from_logp,
    view_from_positions,
)
from stages.generation.vllm_backend import result_from_output
from stages.rl.entropy import EntropyWindow

torch.set_num_threads(1)
P5 = [0.5, 0.2, 0.15, 0.1, 0.05]


def entry(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def vllm_positions(logp_TV: torch.Tensor, ids: list[int], k: int) -> list[dict[int, SimpleNamespace]]:
    """What vLLM returns with logprobs=k: the k best entries (rank 1..k) plus the sampled token's when outside."""
    out = []
    for logp_V, tok in zip(logp_TV.tolist(), ids):
        order = sorted(range(len(logp_V)), key=lambda i: -logp_V[i])
        rank = {t: r + 1 for r, t in enumerate(order)}
        position = {t: entry(logp_V[t], rank[t]) for t in order[:k]}
        position[tok] = entry(logp_V[tok], rank[tok])
        out.append(position)
    return out


def test_topk_and_full_hand_values():
    # p = [0.5, 0.2, 0.15, 0.1, 0.05] over |V| = 5, ln 5 = 1.609438; -p ln p = [0.346574, 0.321888, 0.284568,
    # 0.230259, 0.149787]
    # topk k=2, sampled token 1 (inside): (0.346574 + 0.321888) / ln 5 = 0.415338
    # topk k=2, sampled token 3 (outside, counted as the reference's extra entry): + 0.230259 -> 0.558406
    # full: 1.333076 / ln 5 = 0.828286
    logp = torch.tensor([P5, P5]).log()
    tok = torch.tensor([1, 3])
    assert TokenEntropy("topk", 2).from_logp(logp, tok).tolist() == pytest.approx([0.415338, 0.558406], abs=1e-6)
    assert TokenEntropy("full").from_logp(logp, tok).tolist() == pytest.approx([0.828286] * 2, abs=1e-6)
    # vLLM-style entries (k = 2 best + the sampled one): the same numbers through the same function
    positions = vllm_positions(logp, [1, 3], 2)
    assert len(positions[0]) == 2 and len(positions[1]) == 3
    assert TokenEntropy("topk", 2).from_positions(positions, [1, 3], 5) == pytest.approx([0.415338, 0.558406],
                                                                                         abs=1e-6)


def test_both_backends_report_the_same_entropy():
    # the transformers path (sample_tokens -> TokenEntropy.from_logp) and the vLLM path (result_from_output over
    # its top-10 dicts -> TokenEntropy.from_positions) give one number per token, also when the sampled token is
    # outside the top 10 (token 0 is the sample: sampled with top_k=1 from steering logits where it is the best;
    # in the measured logits it ranks first in rows 0-2 and last in rows 3-5)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=gen) * 2
    logits[:3, 0] = logits[:3].max(-1).values + 1
    logits[3:, 0] = logits[3:].min(-1).values - 1
    steer = torch.zeros(6, 40)
    steer[:, 0] = 5.0
    tok_B = sample_tokens(steer, SamplingSpec(temperature=1.0, top_k=1), gen)[0]
    assert tok_B.tolist() == [0] * 6
    logp = torch.log_softmax(logits, -1)
    hf = TokenEntropy().from_logp(logp, tok_B)
    outside = (logp.topk(10).indices != 0).all(-1)
    assert outside.tolist() == [False] * 3 + [True] * 3
    completion = SimpleNamespace(token_ids=tok_B.tolist(), logprobs=vllm_positions(logp, tok_B.tolist(), 10),
                                 finish_reason="length", stop_reason=None)
    res = result_from_output(completion, frozenset({39}), TokenEntropy(), 40)
    assert res.entropies == pytest.approx(hf.tolist(), abs=1e-6)
    # and through sample_tokens itself (greedy: the sampled token is the argmax, inside the top 10)
    _, _, ent = sample_tokens(logits, SamplingSpec(temperature=0.0))
    assert ent.tolist() == pytest.approx(TokenEntropy().from_logp(logp, logits.argmax(-1)).tolist(), abs=1e-6)


def test_full_quantity_needs_the_whole_distribution():
    view = view_from_positions([{2: entry(-0.1, 1)}], [2], 10)
    with pytest.raises(ValueError, match="entropy_quantity=topk"):
        TokenEntropy("full")(view, 10)
    with pytest.raises(ConfigError, match="entropy_quantity=full needs the whole distribution"):
        load_config("tiny-cpu", ["rl.rollout.backend=vllm", "rl.rollout.entropy_quantity=full"])
    with pytest.raises(ConfigError, match="which verl's servers do not return"):
        load_config("tiny-cpu", ["rl.engine=verl", "rl.rollout.entropy_quantity=full"])
    with pytest.raises(UnknownNameError, match="Known: \\['full', 'surprisal', 'topk'"):
        TokenEntropy("surprise")


def test_surprisal_is_one_quantity_for_every_backend():
    # the sampled token's surprisal -log p / ln|V|: p = 0.1 over |V| = 5 -> -ln 0.1 / ln 5 = 2.302585 / 1.609438
    # = 1.430677, whether the backend has the whole distribution (transformers), vLLM's top entries, or only the
    # sampled log-prob (verl's stock server)
    logp = torch.tensor([P5]).log()
    assert TokenEntropy("surprisal").from_logp(logp, torch.tensor([3])).item() == pytest.approx(1.430677, abs=1e-6)
    assert TokenEntropy("surprisal").from_positions([{3: entry(math.log(0.1), 4)}], [3], 5) == \
        pytest.approx([1.430677], abs=1e-6)
    # a non-finite log-prob counts 0; p = 1 gives -0.0 -> 0
    assert TokenEntropy("surprisal").from_sampled([math.log(0.1), -math.inf, 0.0], 5) == \
        pytest.approx([1.430677, 0.0, 0.0], abs=1e-6)
    view = view_from_logp(logp, torch.tensor([3]), 2)
    assert view.sampled_in_top_B.tolist() == [False] and view.top_BK.shape == (1, 2)
    with pytest.raises(ValueError, match="entropy_quantity=topk"):  # no top-k known: only surprisal applies
        TokenEntropy("full").from_sampled([-1.0], 5)


def test_default_window_sums_and_branch_probabilities_spread():
    # Qwen2.5's vocabulary |V| = 151643, ln|V| = 11.929284. Two realistic top-10 positions:
    #   confident: p = [0.9, 9 x 0.1/9]: H = 0.094824 + 0.449981 = 0.544805 nats -> 0.045670
    #   uncertain: uniform over 10:       H = ln 10 = 2.302585 nats            -> 0.193020
    vocab = 151643
    confident = torch.tensor([[0.9] + [0.1 / 9] * 9]).log()
    uncertain = torch.full((1, 10), 0.1).log()
    h_c = TokenEntropy().from_logp(confident, torch.tensor([0])).item() * math.log(10) / math.log(vocab)
    h_u = TokenEntropy().from_logp(uncertain, torch.tensor([0])).item() * math.log(10) / math.log(vocab)
    assert (h_c, h_u) == (pytest.approx(0.045670, abs=1e-6), pytest.approx(0.193020, abs=1e-6))
    # (the views have |V| = 10 columns, so the lines above rescale from ln 10 to ln|V|)
    # A 20-token segment with j uncertain tokens: H_sum(j) = 20 x 0.045670 + j x 0.147350 = 0.913392 + 0.147350 j.
    # Baseline j = 4. Candidates j = 0, 4, ..., 20: dH_sum = (j - 4) x 0.147350
    #   = [-0.589400, 0, 0.589400, 1.178800, 1.768200, 2.357600]
    #   P = clip(0.5 + 0.2 dH) = [0.382120, 0.5, 0.617880, 0.735760, 0.853640, 0.971520]  (spread 0.589)
    # mean window: dH / 20 -> P = [0.494106, 0.5, 0.505894, 0.511788, 0.517682, 0.523576]  (spread 0.029)
    def segment(j: int) -> list[float]:
        return [h_u] * j + [h_c] * (20 - j)

    section = RolloutSection()
    assert (section.entropy_window, section.entropy_aggregation, section.entropy_tokens) == ("reference", "sum", 20)
    default = EntropyWindow(section.entropy_window, section.entropy_tokens, section.entropy_aggregation)
    mean = EntropyWindow("reference", 20, "mean")
    spread = {}
    for name, window, expected in (
            ("sum", default, [0.382120, 0.5, 0.617880, 0.735760, 0.853640, 0.971520]),
            ("mean", mean, [0.494106, 0.5, 0.505894, 0.511788, 0.517682, 0.523576])):
        base = window.segment_entropy(segment(4))
        dh = [window.segment_entropy(segment(j)) - base for j in range(0, 21, 4)]
        # ARPO's branch probability clip(tau + w dH, 0, 1) at tau 0.5, w 0.2; AEPO with no branches yet (penalty
        # factor 1) has clip(1 - tau + w dH), the same numbers at tau = 0.5 (tests/unit/test_rl_branching.py)
        probs = [min(1.0, max(0.0, 0.5 + 0.2 * d)) for d in dh]
        assert probs == pytest.approx(expected, abs=1e-5)
        spread[name] = max(probs) - min(probs)
    assert spread["sum"] > 0.5 and spread["mean"] < 0.03  # the mean keeps branching a coin flip


def test_positions_without_ranks_sort_by_logprob():
    # entries lacking a rank are ordered by log-prob: top-1 of {ln 0.5, ln 0.2} is ln 0.5, and the sampled
    # token (ln 0.2) is outside it -> (0.346574 + 0.321888) / ln 5 = 0.415338
    position = {4: SimpleNamespace(logprob=math.log(0.2), rank=None), 7: SimpleNamespace(logprob=math.log(0.5),
                                                                                         rank=None)}
    assert TokenEntropy("topk", 1).from_positions([position], [4], 5) == pytest.approx([0.415338], abs=1e-6)
