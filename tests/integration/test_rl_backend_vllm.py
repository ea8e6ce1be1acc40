"""The vLLM rollout backend for real, on CPU, in CI: `rl.rollout.backend: vllm` under the vLLM interpreter.

vLLM cannot be imported here (its pins clash with the main venv), so `tests/integration/vllm_probe.py` runs under
.venv-vllm/bin/python once per module: it builds the backend as the RL stage does (stages.generation.session), generates
greedily with the closing tool tags as stops and rolls out one ARPO group per prompt with the real tools. The
assertions are here; that the engine follows the trainer's weights is tests/integration/test_rl_weight_sync.py.
Only the CUDA-specific part (GPU memory share, weights on the device) stays behind the `gpu` marker below.

The untrained 135M model rarely opens a tool call by itself, so each prompt ends with an assistant prefix that
opens a search ("...</think>\\n<search>"), as in test_rl_rollout.py; the model writes the query and closes the tag.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from types import SimpleNamespace

import pytest

from stages.core.env import PROJECT_ROOT
from tests.conftest import require_vllm_env
from tests.integration.test_rl_rollout import check_groups

pytestmark = pytest.mark.integration
MAX_RESPONSE = 112
ROLLOUT = {"n": 4, "initial_rollouts": 2, "beam_size": 2, "call_limit": 2,
           "max_prompt_length": 1024, "max_response_length": MAX_RESPONSE, "temperature": 1.0, "entropy_tokens": 8,
           "branch_probability": 1.0, "entropy_weight": 0.0}  # tau = 1: every candidate branches while budget lasts


@pytest.fixture(scope="module")
def probe(tiny_model, synthetic_data, tmp_path_factory) -> dict:
    python = require_vllm_env()
    tmp = tmp_path_factory.mktemp("vllm-probe")
    request, result = tmp / "request.json", tmp / "result.json"
    request.write_text(json.dumps({"model": tiny_model.path, "data": synthetic_data.model_dump(mode="json"),
                                   "cache": str(tmp / "tool-cache"), "rollout": ROLLOUT}))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([str(python), "-m", "tests.integration.vllm_probe", str(request), str(result)],
                          check=False, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and result.is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.path)


def test_engine_is_vllm_token_in_token_out_with_tool_stops(probe, tokenizer) -> None:
    assert probe["backend"] == "VLLMBackend" and probe["vocab_size"] == len(tokenizer)
    g = probe["greedy"]
    # the primer opened <search>; greedy writes a query and closes it: vLLM stops on the closing tag and keeps it
    assert g["finish_reason"] == "stop" and g["stop"] == "</search>"
    assert tokenizer.decode(g["token_ids"]).endswith("</search>") and g["text"].endswith("</search>")
    assert len(g["token_ids"]) == len(g["logprobs"]) == len(g["entropies"]) > 0
    # the sampled ids are the model's own tokens: the trainer scores them at the log-probs vLLM reported
    # (fp32 on both sides; measured ~1e-5, the tolerance of test_eval_vllm_parity.py)
    assert max(abs(a - b) for a, b in zip(g["logprobs"], g["trainer_logprobs"])) <= 1e-3
    # log-probs of real tokens, and the top-k entropy normalised by ln|V| lies in [0, 1]
    assert all(lp <= 0 for lp in g["logprobs"]) and all(0 <= h <= 1 for h in g["entropies"])
    # one branching entropy on every backend (issue 11): vLLM's top-10 log-probs give the number the transformers
    # backend computes from the full distribution (top-10 + the sampled token outside them, / ln|V|)
    assert max(abs(a - b) for a, b in zip(g["entropies"], g["trainer_entropies"])) <= 1e-3


def test_arpo_group_with_real_tools(probe, tokenizer) -> None:
    groups = [SimpleNamespace(trajectories=[SimpleNamespace(**t, sample_logprobs=t["logprobs"]) for t in g])
              for g in probe["groups"]]
    assert check_groups(SimpleNamespace(groups=groups), ROLLOUT["n"]) > 0   # n per group; branches share prefixes
    assert probe["metrics"]["tool_calls"] > 0 and probe["metrics"]["branches"] > 0
    for t in (t for g in groups for t in g.trajectories):
        assert all(0 <= h <= 1 for h in t.entropies) and any(h > 0 for h in t.entropies)   # top-k entropy present
        assert all(lp <= 0 for lp in t.logprobs)
        if 0 in t.loss_mask:  # a tool result: masked, starting ' <result>', right after a closing tool tag
            start = t.loss_mask.index(0)
            assert tokenizer.decode(t.response_ids[start:start + 3]).startswith(" <result>")
            assert tokenizer.decode(t.response_ids[:start]).endswith(("</search>", "</python>"))


# ------------------------------------------------------------------------- CUDA only: run under .venv-vllm on a GPU
@pytest.fixture(scope="module")
def cuda_setup(tiny_model):
    pytest.importorskip("vllm", reason="vLLM lives in its own environment; run this under .venv-vllm/bin/python")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.generation import load_backend

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32,
                                                 attn_implementation="sdpa").cuda()
    backend = load_backend("vllm", model, tok, model_path=tiny_model.path, gpu_memory_utilization=0.3,
                           max_model_len=2048, engine_kwargs={"dtype": "float32"})
    return model, tok, backend


@pytest.mark.gpu
def test_cuda_weights_on_the_device_follow_the_trainer(cuda_setup) -> None:
    import torch

    from stages.generation import GenRequest, SamplingSpec

    model, tok, backend = cuda_setup
    out = tok.apply_chat_template([{"role": "user", "content": "Name the capital of France."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    (res,) = backend.generate([GenRequest(0, ids, 32)], SamplingSpec(temperature=0.0, stop=(".",)))
    with torch.no_grad():  # sampled log-probs equal the trainer model's on the GPU (fp32 on both sides)
        logits = model(torch.tensor([ids + res.token_ids]).cuda()).logits[0, len(ids) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.token_ids).cuda()[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(res.logprobs), expected.cpu(), atol=2e-3)
    with torch.no_grad():
        saved = model.model.norm.weight.clone()
        model.model.norm.weight.zero_()
    try:
        backend.refresh_weights()  # CUDA tensors handed to the engine on the same device
        (flat,) = backend.generate([GenRequest(1, ids, 4)], SamplingSpec(temperature=1.0), seed=0)
        assert all(abs(lp + math.log(backend.vocab_size)) < 1e-3 for lp in flat.logprobs)
    finally:
        with torch.no_grad():
            model.model.norm.weight.copy_(saved)
        backend.refresh_weights()


def test_a_batch_wider_than_the_scheduler_budget_with_seeded_requests(probe) -> None:
    # 64 prompts of ~300 tokens: > 4096 prompt tokens in one call, each request seeded; chunked prefill would
    # crash here ("CPU Generator does not use offset"); every request returns its one token
    wide = probe["wide_batch"]
    assert wide["prompt_tokens"] > 4096 and wide["generated"] == [1] * 64
