"""Parity: the same model, prompt and greedy decoding give the same tokens and log-probs from our transformers
generation backend (the RL rollouts on CPU) and from vLLM's OpenAI server (serving and eval).

Tolerance: token ids identical; log-probs within 1e-3 nats. Both run the fp32 weights; vLLM's CPU kernels (oneDNN
matmuls, its own attention) round differently from torch's, which we measured at ~1e-5 per token on this model
(docs/eval.md). 1e-3 leaves room for other CPUs and stays far below the gaps between competing tokens that would
change a greedy choice. The vLLM rollout backend's side of the same check is in test_rl_backend_vllm.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from stages.eval.serving import async_client

pytestmark = pytest.mark.integration
TOLERANCE = 1e-3
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tiny_model, synthetic_data) -> list[list[int]]:
    from transformers import AutoTokenizer

    from stages.agent.prompt_templates import build_messages

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    questions = [json.loads(line)["question"] for line in
                 Path(synthetic_data.file("eval_test")).read_text().splitlines()[:3]]
    texts = [tok.apply_chat_template(build_messages(q), tokenize=False, add_generation_prompt=True)
             for q in questions] + ["1, 2, 3, 4,"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def transformers_greedy(model_path: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.generation import GenRequest, SamplingSpec, load_backend

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    backend = load_backend("transformers", model, tok)
    results = backend.generate([GenRequest(i, ids, MAX_TOKENS) for i, ids in enumerate(prompts)],
                               SamplingSpec(temperature=0.0))
    return [(r.token_ids, r.logprobs) for r in results]


def vllm_greedy(endpoint, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    async def one(client, ids):
        response = await client.completions.create(model=endpoint.model, prompt=ids, max_tokens=MAX_TOKENS,
                                                   temperature=0, logprobs=1,
                                                   extra_body={"return_token_ids": True, "skip_special_tokens": False})
        choice = response.choices[0]
        return list(choice.model_extra["token_ids"]), list(choice.logprobs.token_logprobs)

    async def go():
        client = async_client(endpoint)
        try:
            return [await one(client, ids) for ids in prompts]
        finally:
            await client.close()

    return asyncio.run(go())


def test_transformers_backend_and_vllm_server_agree(tiny_model, vllm_endpoint, prompts) -> None:
    ours = transformers_greedy(tiny_model.path, prompts)
    theirs = vllm_greedy(vllm_endpoint, prompts)
    worst = 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(ours, theirs):
        assert ids_a == ids_b                          # identical greedy tokens (EOS included where it ended)
        assert len(lp_a) == len(lp_b) == len(ids_a) > 0
        worst = max(worst, max(abs(a - b) for a, b in zip(lp_a, lp_b)))
    assert worst <= TOLERANCE, f"log-probs differ by up to {worst:.2e} nats"
