"""Runs under the vLLM interpreter (.venv-vllm/bin/python), driven by tests/integration/test_rl_weight_sync.py and
tests/integration/test_rl_backend_vllm.py: does the vLLM rollout backend sample from the trainer's current weights?

    .venv-vllm/bin/python -m tests.integration.sync_probe <request.json> <result.json>

For each model folder in the request: the trainer's torch model and the vLLM backend built on it (as the RL stage
builds them); then, per parameter group (embedding / tied head, untied head, norms, q/k/v/o with their biases, q/k
norms, MLP), the group is perturbed in the trainer, the backend refreshed, a few tokens sampled by vLLM, and the
trainer's teacher-forced log-probs of those tokens computed: the two must agree (the sampler is the policy), and
the perturbation must have moved the trainer's log-probs by far more than that tolerance (so a sampler that kept
the old group would fail). Last, a refresh that leaves a tensor out (the old `named_parameters()` one, which drops
a tied head's second name) must raise SamplerSyncError naming the layer. The assertions live in the tests.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# parameter groups by name fragment; "head" is the untied LM head (a tied one is the embedding's second name)
GROUPS = {"embedding": ("embed_tokens",), "head": ("lm_head",), "norms": ("norm.", "layernorm."),
          "attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "qk_norms": ("q_norm", "k_norm"),
          "mlp": ("gate_proj", "up_proj", "down_proj")}
PROMPT = "Name the capital of France."


def group_names(model) -> dict[str, list[str]]:
    """Parameter names of each group present in `model` (a tied head has no group of its own)."""
    names = [n for n, _ in model.named_parameters()]  # one name per tensor: each tensor is perturbed once
    out = {}
    for group, fragments in GROUPS.items():
        chosen = [n for n in names if any(f in n for f in fragments)]
        if group == "norms":  # q/k norms are a group of their own
            chosen = [n for n in chosen if "q_norm" not in n and "k_norm" not in n]
        if chosen:
            out[group] = chosen
    return out


def sampled_vs_trainer(backend, model, prompt_ids: list[int], tokens: int, seed: int) -> tuple[list[int], list[float],
                                                                                               list[float]]:
    """Tokens vLLM samples (temperature 1), its log-probs of them, and the trainer's teacher-forced log-probs."""

    from stages.generation import GenRequest, SamplingSpec

    (res,) = backend.generate([GenRequest(0, prompt_ids, tokens)], SamplingSpec(temperature=1.0), seed=seed)
    return res.token_ids, res.logprobs, trainer_logprobs(model, prompt_ids, res.token_ids, backend.vocab_size)


def trainer_logprobs(model, prompt_ids: list[int], token_ids: list[int], vocab: int) -> list[float]:
    """Teacher-forced log-probs over the ids the sampler may draw (`vocab`: the tokenizer's, when the embedding has
    padding rows, as Qwen's 151,936 rows for 151,669 tokens: the backend masks the rest, so its log-probs are
    normalised over these; over all rows they would differ by log(mass of all rows / mass of these), 1.8e-3 on a
    random-init toy, whatever the weights)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1:-1, :vocab].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1).tolist()


def probe_model(spec: dict, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.generation.vllm_backend import VLLMBackend
    from stages.generation.weight_sync import SamplerSyncError, reload_audited

    tok = AutoTokenizer.from_pretrained(spec["path"])
    model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32, attn_implementation="sdpa")
    started = time.monotonic()
    backend = VLLMBackend(model, tok, model_path=spec["path"], max_model_len=512, gpu_memory_utilization=0.1,
                          engine_kwargs={"dtype": "float32"})
    out = {"name": spec["name"], "tied": bool(model.config.tie_word_embeddings), "model_type": model.config.model_type,
           "engine_start_s": round(time.monotonic() - started, 1), "groups": {}}
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(0)
    for i, (group, names) in enumerate(group_names(model).items()):
        saved = {n: params[n].detach().clone() for n in names}
        ids_before, _, _ = sampled_vs_trainer(backend, model, prompt_ids, tokens, seed=i)
        before = trainer_logprobs(model, prompt_ids, ids_before, backend.vocab_size)
        with torch.no_grad():
            for n in names:  # noise at a fixed share of each tensor's own spread (a norm's ones: of 1)
                p = params[n]
                p.add_(torch.randn(p.shape, generator=generator) * spec["scale"] * max(float(p.std()), 0.02))
        after = trainer_logprobs(model, prompt_ids, ids_before, backend.vocab_size)
        moved = max(abs(a - b) for a, b in zip(before, after))
        backend.refresh_weights()
        ids, sampled, trainer = sampled_vs_trainer(backend, model, prompt_ids, tokens, seed=i)
        out["groups"][group] = {"tensors": len(names), "moved": moved, "tokens": len(ids),
                                "max_abs_diff": max(abs(a - b) for a, b in zip(sampled, trainer))}
        with torch.no_grad():
            for n in names:
                params[n].copy_(saved[n])
        backend.refresh_weights()
    if out["tied"]:  # the refresh before the fix: one name per tensor, so the tied head's own name never travels
        try:
            reload_audited(backend.llm, [(n, p.data) for n, p in model.named_parameters()])
            out["dedup_refresh_error"] = None
        except SamplerSyncError as exc:
            out["dedup_refresh_error"] = str(exc)
        backend.refresh_weights()
    backend.close()
    return out


def main(request_path: str, result_path: str) -> None:
    import torch

    req = json.loads(Path(request_path).read_text())
    torch.set_num_threads(1)
    results = [probe_model(spec, req.get("tokens", 16)) for spec in req["models"]]
    Path(result_path).write_text(json.dumps({"models": results}))


if __name__ == "__main__":
    from stages.core.env import configure_environment

    configure_environment()
    main(sys.argv[1], sys.argv[2])
