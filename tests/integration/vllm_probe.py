"""Runs under the vLLM interpreter (.venv-vllm/bin/python), driven by tests/integration/test_rl_backend_vllm.py.

    .venv-vllm/bin/python -m tests.integration.vllm_probe <request.json> <result.json>

vLLM's pins clash with the main venv, so the test process cannot import it; this script builds the vLLM rollout
backend exactly as the RL stage does with `rl.rollout.backend: vllm` (stages.generation.session.RolloutSession), runs a
token-in/token-out generation and an ARPO group with the real tools, and writes what came out as JSON (the
weight refresh is tests/integration/sync_probe.py's). The assertions live in the test, which runs in the main venv.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PRIMER = "<think>I will search for it.</think>\n<search>"


def trainer_logprobs(model, context: list[int], generated: list[int]) -> tuple[list[float], list[float]]:
    """Log-probs of `generated` after `context` under the trainer's torch model (teacher forcing), and the
    branching entropy the transformers backend computes from those full distributions (TokenEntropy, top-10)."""
    import torch

    from stages.generation.token_entropy import TokenEntropy

    with torch.no_grad():
        logits = model(torch.tensor([context + generated])).logits[0, len(context) - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    tokens = torch.tensor(generated)
    return (logp.gather(-1, tokens[:, None]).squeeze(-1).tolist(),
            TokenEntropy().from_logp(logp, tokens).tolist())


def main(request_path: str, result_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.core.config.agent import AgentSection, SearchSection
    from stages.core.config.rl import RLSection
    from stages.core.refs import DatasetRef
    from stages.core.rl_parquet import read_rl_parquet
    from stages.generation import GenRequest, SamplingSpec
    from stages.generation.prompt_items import PromptItem, build_prompt_items
    from stages.generation.session import RolloutSession
    from stages.rl.rollout import TreeRollout

    req = json.loads(Path(request_path).read_text())
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(req["model"])
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32, attn_implementation="sdpa")
    cfg = RLSection.model_validate({"algorithm": "arpo", "rollout": {**req["rollout"], "backend": "vllm"}})
    agent = AgentSection(search=SearchSection(top_k=1, max_chars_per_passage=120))
    data = DatasetRef.model_validate(req["data"])
    started = time.monotonic()
    session = RolloutSession(cfg.rollout.generation(), agent, model, tok, data, Path(req["cache"]), seed=0)
    out: dict = {"engine_startup_s": round(time.monotonic() - started, 1), "backend": type(session.backend).__name__,
                 "vocab_size": session.backend.vocab_size}
    rows = [r for r in read_rl_parquet(data.file("rl_train")) if r.ability == "qa"][:2]
    primer = tok.encode(PRIMER, add_special_tokens=False)
    prompts = [PromptItem(p.group, p.prompt_ids + primer, p.question, p.ground_truth, p.ability)
               for p in build_prompt_items(rows, tok, max_prompt_length=cfg.rollout.max_prompt_length)]

    # token in / token out: greedy, the closing tool tags as stops
    (res,) = session.backend.generate([GenRequest(0, prompts[0].prompt_ids, 48)],
                                      SamplingSpec(temperature=0.0, stop=("</search>", "</python>")))
    out["greedy"] = {"prompt_ids": prompts[0].prompt_ids, "token_ids": res.token_ids, "logprobs": res.logprobs,
                     "entropies": res.entropies, "finish_reason": res.finish_reason, "stop": res.stop,
                     "text": tok.decode(res.token_ids),
                     **dict(zip(("trainer_logprobs", "trainer_entropies"),
                                trainer_logprobs(model, prompts[0].prompt_ids, res.token_ids)))}

    # more prompt tokens than the scheduler's 4096 per step, every request with its own seed: chunked prefill
    # would split one prefill and crash vLLM 0.32 on CPU; the backend turns it off (stages/generation/vllm_backend.py)
    wide = [GenRequest(("wide", i), prompts[i % len(prompts)].prompt_ids, 1) for i in range(64)]
    out["wide_batch"] = {"prompt_tokens": sum(len(r.token_ids) for r in wide),
                         "generated": [len(r.token_ids) for r in session.backend.generate(wide, SamplingSpec(), seed=0)]}

    # an ARPO group with the real tools (tau = 1: every candidate branches while budget remains)
    tree = TreeRollout(session.backend, session.toolbox, tok, cfg.rollout, cfg.algorithm, seed=0, show_progress=False)
    batch = tree.rollout(prompts)
    out["metrics"] = {k: v for k, v in batch.metrics.items() if isinstance(v, (int, float))}
    out["groups"] = [[{"traj_id": t.traj_id, "parent_id": t.parent_id, "kind": t.kind, "fork_at": t.fork_at,
                       "response_ids": t.response_ids, "loss_mask": t.loss_mask, "logprobs": t.sample_logprobs,
                       "entropies": t.entropies, "text": tok.decode(t.response_ids)} for t in g.trajectories]
                     for g in batch.groups]

    session.close()
    Path(result_path).write_text(json.dumps(out))


if __name__ == "__main__":
    from stages.core.env import configure_environment

    configure_environment()
    main(sys.argv[1], sys.argv[2])
