"""The transformers generation backend on the real tiny model (SmolLM2-135M-Instruct, CPU).

KV reuse must be invisible in the samples: greedy decoding with cached prefixes (across rounds and forks) gives
the same tokens as re-prefilling every context, the sampling log-probs equal a teacher-forced forward over the
final sequences, and it costs fewer forward tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from stages.generation import GenRequest, SamplingSpec, load_backend

pytestmark = pytest.mark.integration

QUESTIONS = ["What is 2+2?", "Name the capital of France.", "Write one word about the sea."]
RESULT = " <result>\nParis is the capital of France.\n</result>"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32, attn_implementation="sdpa")
    return model, tok


def prompt_ids(tok, question: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def three_rounds(backend, tok, sampling: SamplingSpec, seed: int | None = None):
    """Round 1 from shared prompt caches; round 2 after a tool result; round 3 on forks of round-2 contexts."""
    prompts = [prompt_ids(tok, q) for q in QUESTIONS]
    backend.prefill([(("prompt", i), p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        backend.fork(("prompt", i), i, len(p))
    r1 = backend.generate([GenRequest(i, p, 12) for i, p in enumerate(prompts)], sampling, seed=seed)
    result = tok.encode(RESULT, add_special_tokens=False)
    ctx2 = [p + r.token_ids + result for p, r in zip(prompts, r1)]
    r2 = backend.generate([GenRequest(i, c, 10) for i, c in enumerate(ctx2)], sampling, seed=seed)
    forks = []
    for i, c in enumerate(ctx2):  # a branch forks right after the result: shares prompt + segment 1 + result
        backend.fork(i, 10 + i, len(c))
        forks.append(GenRequest(10 + i, c, 10))
    r3 = backend.generate(forks, sampling, seed=seed)
    backend.release()
    return prompts, ctx2, r1, r2, r3


def test_kv_reuse_equals_reprefill_under_greedy(model_and_tokenizer):
    model, tok = model_and_tokenizer
    greedy = SamplingSpec(temperature=0.0)
    fast = load_backend("transformers", model, tok, kv_reuse=True)
    slow = load_backend("transformers", model, tok, kv_reuse=False)
    prompts, _, a1, a2, a3 = three_rounds(fast, tok, greedy)
    *_, b1, b2, b3 = three_rounds(slow, tok, greedy)
    for a, b in zip(a1 + a2 + a3, b1 + b2 + b3):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        # same distribution up to float32 reduction order in differently shaped batches
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert max(abs(x - y) for x, y in zip(a.entropies, b.entropies)) < 1e-4
    # greedy forks of an identical context reproduce their parent's round-2 continuation
    assert [r.token_ids for r in a3] == [r.token_ids for r in a2]
    # every context token of a generate call is either recomputed or served from a cache, so both modes see the
    # same contexts; reuse also paid one prompt pass (all prompt tokens but the last) in prefill()
    prompt_pass = sum(len(p) - 1 for p in prompts)
    assert fast.stats.prefill_tokens + fast.stats.reused_tokens == slow.stats.prefill_tokens + prompt_pass
    assert fast.stats.decode_tokens == slow.stats.decode_tokens
    assert fast.stats.forward_tokens < slow.stats.forward_tokens


def test_greedy_matches_hf_generate(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompt_ids(tok, QUESTIONS[1])
    backend = load_backend("transformers", model, tok)
    (res,) = backend.generate([GenRequest(0, ids, 16)], SamplingSpec(temperature=0.0))
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=16, do_sample=False)
    assert res.token_ids == ref[0, len(ids):].tolist()[:len(res.token_ids)]


def test_sampled_logprobs_match_teacher_forcing(model_and_tokenizer):
    model, tok = model_and_tokenizer
    backend = load_backend("transformers", model, tok, kv_reuse=True)
    prompts, ctx2, r1, r2, r3 = three_rounds(backend, tok, SamplingSpec(temperature=0.8, top_p=0.95), seed=3)
    for i in range(len(QUESTIONS)):
        for context, res in ((prompts[i], r1[i]), (ctx2[i], r2[i]), (ctx2[i], r3[i])):
            full = torch.tensor([context + res.token_ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(context) - 1:-1].float()
            logp_TV = torch.log_softmax(logits / 0.8, -1)
            target = torch.tensor(res.token_ids)
            expected = logp_TV.gather(-1, target[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)
            # the reference's quantity, by hand: -p log p over the 10 best tokens, plus the sampled one when it is
            # not among them, / ln|V|
            ent = []
            for logp_V, tok in zip(logp_TV, res.token_ids):
                top = logp_V.topk(10)
                terms = [-(lp.exp() * lp).item() for lp in top.values]
                if tok not in top.indices.tolist():
                    terms.append(-(logp_V[tok].exp() * logp_V[tok]).item())
                ent.append(sum(terms) / math.log(logits.shape[-1]))
            assert torch.allclose(torch.tensor(res.entropies), torch.tensor(ent), atol=1e-4)


def test_stop_strings_keep_the_stop_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    backend = load_backend("transformers", model, tok)
    ids = prompt_ids(tok, "Say hello, then a full stop.")
    results = backend.generate([GenRequest(i, ids, 40) for i in range(4)],
                               SamplingSpec(temperature=1.0, stop=(".", "!")), seed=0)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped, "none of 4 samples wrote '.' or '!' within 40 tokens"
    for r in stopped:
        text = tok.decode(r.token_ids)
        assert r.stop in text                                 # the token that completed the stop string is kept
        assert r.stop not in tok.decode(r.token_ids[:-1])     # and generation stopped right there
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) == len(r.entropies) <= 40
        assert all(0.0 <= h <= 1.0 for h in r.entropies)
