"""Generation-backend pieces that need no model: sampling math, KV batch layout and masks,
the vLLM parameter/result conversion, the factory."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stages.core.registry import UnknownNameError
from stages.generation import (
    BACKENDS,
    GenRequest,
    GenResult,
    SamplingSpec,
    load_backend,
)
from stages.generation.base import ForwardStats
from stages.generation.kvcache import (
    SeqCache,
    assemble,
    attention_mask_4d,
    common_prefix,
)
from stages.generation.sampling import sample_tokens
from stages.generation.token_entropy import TokenEntropy
from stages.generation.vllm_backend import (
    VLLMNotInstalledError,
    result_from_output,
    sampling_kwargs,
)
from tests.unit.test_rl_rollout_fakes import ToyTokenizer

torch.set_num_threads(1)


def test_sampled_logprob_and_entropy_hand_values():
    # p = softmax([0, ln 3]) = [0.25, 0.75]; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335 nats; / ln 2 = 0.811278
    # (|V| = 2 <= k: the top-k entropy is the full entropy)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    _, logp, ent = sample_tokens(logits, SamplingSpec(temperature=0.0))
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(0.811278, abs=1e-6)
    # temperature 2 on [0, ln 9] scales to [0, ln 3]: the same distribution
    gen = torch.Generator().manual_seed(0)
    _, _, ent_t = sample_tokens(torch.tensor([[0.0, math.log(9.0)]]), SamplingSpec(temperature=2.0), gen)
    assert ent_t.item() == pytest.approx(0.811278, abs=1e-6)
    # uniform over 8 tokens: the full entropy is ln 8 / ln 8 = 1
    flat = torch.zeros(1, 8)
    assert sample_tokens(flat, SamplingSpec(temperature=0.0), entropy=TokenEntropy("full"))[2].item() == \
        pytest.approx(1.0, abs=1e-6)


def test_sample_tokens_greedy_and_truncation():
    logits = torch.tensor([[0.0, math.log(3.0)], [2.0, 0.0]])
    tok, logp, ent = sample_tokens(logits, SamplingSpec(temperature=0.0))
    assert tok.tolist() == [1, 0]
    assert logp[0].item() == pytest.approx(math.log(0.75), abs=1e-6)  # greedy log-probs use T = 1
    assert ent[0].item() == pytest.approx(0.811278, abs=1e-6)
    gen = torch.Generator().manual_seed(0)
    flat = torch.zeros(64, 10)
    flat[:, 3] = 0.5  # token 3 is the most likely of 10
    for spec in (SamplingSpec(temperature=1.0, top_k=1), SamplingSpec(temperature=1.0, top_p=0.05)):
        tok, logp, _ = sample_tokens(flat, spec, gen)
        assert tok.tolist() == [3] * 64  # truncation leaves only the argmax
        # the reported log-prob is of the untruncated distribution: e^0.5 / (e^0.5 + 9)
        assert logp[0].item() == pytest.approx(0.5 - math.log(math.exp(0.5) + 9), abs=1e-6)


def test_sampling_is_seeded():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    spec = SamplingSpec(temperature=1.0)
    a = sample_tokens(logits, spec, torch.Generator().manual_seed(7))[0]
    b = sample_tokens(logits, spec, torch.Generator().manual_seed(7))[0]
    assert torch.equal(a, b)


def test_request_and_spec_validation():
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        GenRequest("k", [1, 2], 0)
    with pytest.raises(ValueError, match="at least one token"):
        GenRequest("k", [], 4)
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=0.0)
    with pytest.raises(ValueError, match="finish_reason"):
        GenResult([1], [0.0], [0.0], "done")


def test_forward_stats_arithmetic():
    a = ForwardStats(prefill_tokens=10, decode_tokens=5, reused_tokens=7, padded_tokens=20, forward_calls=3)
    b = a.copy()
    b.prefill_tokens += 4
    b.decode_tokens += 2
    assert b.since(a).as_dict() == {"prefill_tokens": 4, "decode_tokens": 2, "reused_tokens": 0,
                                    "padded_tokens": 0, "forward_calls": 0, "forward_tokens": 6}


def test_attention_mask_4d_causal_valid_and_diagonal():
    # valid [T, F, T], two query columns (k = 1, 2):
    #   q=1: keys <= 1 and valid -> [T, F, F], plus itself (pad query) -> [T, T, F]
    #   q=2: keys <= 2 and valid -> [T, F, T]
    mask = attention_mask_4d(torch.tensor([[True, False, True]]), 2, None)
    assert mask.shape == (1, 1, 2, 3)
    assert mask[0, 0].tolist() == [[True, True, False], [True, False, True]]
    additive = attention_mask_4d(torch.tensor([[True, False, True]]), 1, torch.float32)
    assert additive[0, 0, 0].tolist() == [0.0, torch.finfo(torch.float32).min, 0.0]


def test_assemble_layout():
    # row 0: 2 cached tokens, pending [7]; row 1: no cache, pending [8, 9] -> L = 2, S = 2
    kv = [(torch.arange(6.0).view(1, 2, 3), torch.arange(6.0).view(1, 2, 3) + 100)]
    batch = assemble([SeqCache([4, 5], kv), None], [[7], [8, 9]], pad_id=0, device=torch.device("cpu"))
    assert batch.valid_BK.tolist() == [[True, True, False, True], [False, False, True, True]]
    assert batch.input_ids_BS.tolist() == [[0, 7], [8, 9]]
    assert batch.position_ids_BS.tolist() == [[0, 2], [0, 1]]   # real positions; the pad's is unused
    assert batch.n_real_B.tolist() == [3, 2]
    keys = batch.cache.layers[0].keys
    assert keys.shape == (2, 1, 2, 3) and torch.equal(keys[0, 0], kv[0][0][0]) and keys[1].abs().sum() == 0


def test_seq_cache_truncation_and_prefix():
    kv = [(torch.arange(8.0).view(1, 4, 2), torch.zeros(1, 4, 2))]
    c = SeqCache([1, 2, 3, 4], kv).truncated(2)
    assert c.ids == [1, 2] and c.kv[0][0].shape == (1, 2, 2) and c.kv[0][0][0, 1].tolist() == [2.0, 3.0]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


def test_vllm_sampling_kwargs():
    kw = sampling_kwargs(SamplingSpec(temperature=0.0, stop=("</search>",)), 32, 5, 10, None)
    assert kw == {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 32, "stop": ["</search>"],
                  "include_stop_str_in_output": True, "logprobs": 10, "skip_special_tokens": False, "seed": 5}
    kw = sampling_kwargs(SamplingSpec(temperature=0.7, top_k=20), 8, None, 10, allowed_vocab=4)
    assert kw["top_k"] == 20 and kw["temperature"] == 0.7 and kw["allowed_token_ids"] == [0, 1, 2, 3]


def lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_vllm_topk_entropy():
    half = math.log(0.5)
    # two entries of p = 0.5: H = ln 2; |V| = 4 -> ln 2 / ln 4 = 0.5
    assert TokenEntropy("topk", 10).from_positions([{3: lp(half, 1), 5: lp(half, 2)}], [3], 4) == \
        pytest.approx([0.5])
    # k = 1 keeps the best-ranked entry, and the sampled token outside it counts too (the reference flattens
    # every entry vLLM returns): (0.5 ln 2 + 0.1 ln 10) / ln 4
    assert TokenEntropy("topk", 1).from_positions([{3: lp(half, 1), 9: lp(math.log(0.1), 7)}], [9], 4) == \
        pytest.approx([(0.5 * math.log(2) + 0.1 * math.log(10)) / math.log(4)])


def test_vllm_result_conversion():
    half = math.log(0.5)
    positions = [{7: lp(half, 1), 8: lp(half, 2)}, {2: lp(-0.1, 1)}]
    eos = frozenset({2})
    stop = SimpleNamespace(token_ids=[7, 9], logprobs=[positions[0], {9: lp(-0.2, 1)}], finish_reason="stop",
                           stop_reason="</search>")
    res = result_from_output(stop, eos, TokenEntropy(), 4)
    assert (res.token_ids, res.finish_reason, res.stop) == ([7, 9], "stop", "</search>")
    assert res.logprobs == pytest.approx([half, -0.2])
    by_eos = SimpleNamespace(token_ids=[7, 2], logprobs=positions, finish_reason="stop", stop_reason=None)
    assert result_from_output(by_eos, eos, TokenEntropy(), 4).finish_reason == "eos"
    cut = SimpleNamespace(token_ids=[7, 2], logprobs=positions, finish_reason="length", stop_reason=None)
    assert result_from_output(cut, eos, TokenEntropy(), 4).finish_reason == "length"
    no_lp = SimpleNamespace(token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)
    with pytest.raises(RuntimeError, match="logprob"):
        result_from_output(no_lp, eos, TokenEntropy(), 4)


def test_factory():
    assert BACKENDS.names() == ["transformers", "vllm"]
    with pytest.raises(UnknownNameError, match="Known: \\['transformers', 'vllm'\\]"):
        load_backend("hf", None, None)
    with pytest.raises(VLLMNotInstalledError, match="own environment"):
        load_backend("vllm", None, ToyTokenizer())
