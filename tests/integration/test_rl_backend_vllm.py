"""The vLLM backend on a GPU box, in vLLM's own environment (skipped where CUDA or vllm is missing)."""

from __future__ import annotations

import math

import pytest
import torch

from stages.rl.backends import GenRequest, SamplingSpec, load_backend
from stages.rl.entropy import TokenEntropy

pytestmark = [pytest.mark.integration, pytest.mark.gpu]


@pytest.fixture(scope="module")
def vllm_setup(tiny_model):
    pytest.importorskip("vllm", reason="vLLM lives in its own environment; run this under that interpreter")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32,
                                                 attn_implementation="sdpa").cuda()
    backend = load_backend("vllm", model, tok, model_path=tiny_model.path, gpu_memory_utilization=0.3,
                           max_model_len=2048, engine_kwargs={"dtype": "float32"})
    return model, tok, backend


def prompt_ids(tok, question: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_vllm_token_in_token_out_with_stops(vllm_setup):
    model, tok, backend = vllm_setup
    ids = prompt_ids(tok, "Name the capital of France.")
    (res,) = backend.generate([GenRequest(0, ids, 32)], SamplingSpec(temperature=0.0, stop=(".",)))
    assert res.finish_reason in ("stop", "eos", "length") and 0 < len(res.token_ids) <= 32
    if res.finish_reason == "stop":
        assert res.stop == "." and "." in tok.decode(res.token_ids)
    with torch.no_grad():  # sampled log-probs equal the trainer model's (fp32 on both sides)
        logits = model(torch.tensor([ids + res.token_ids]).cuda()).logits[0, len(ids) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.token_ids).cuda()[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(res.logprobs), expected.cpu(), atol=2e-3)
    # the branching entropy is the quantity the transformers backend computes from the full distribution
    # (top-10 + the sampled token, / ln|V|): one number per token on both backends
    entropy = TokenEntropy().from_logp(torch.log_softmax(logits, -1), torch.tensor(res.token_ids).cuda())
    assert torch.allclose(torch.tensor(res.entropies), entropy.cpu(), atol=2e-3)
    assert backend.stats.decode_tokens == len(res.token_ids)


def test_vllm_refresh_weights_follows_the_trainer(vllm_setup):
    model, tok, backend = vllm_setup
    ids = prompt_ids(tok, "Say something.")
    with torch.no_grad():
        saved = model.model.norm.weight.clone()
        model.model.norm.weight.zero_()  # zero final norm -> zero logits -> uniform next-token distribution
    try:
        backend.refresh_weights()
        (res,) = backend.generate([GenRequest(0, ids, 4)], SamplingSpec(temperature=1.0), seed=0)
        # every token of a uniform distribution has log-prob -ln|V|
        assert all(abs(lp + math.log(backend.vocab_size)) < 1e-3 for lp in res.logprobs)
    finally:
        with torch.no_grad():
            model.model.norm.weight.copy_(saved)
        backend.refresh_weights()
