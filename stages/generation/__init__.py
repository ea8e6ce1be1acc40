"""Generation backends behind one protocol (`base.GenerationBackend`), built by name with `load_backend`.

    backend = load_backend("transformers", model, tokenizer, kv_reuse=True)
    results = backend.generate([GenRequest(key, token_ids, max_new_tokens)], SamplingSpec(stop=("</search>",)))

`vllm` is imported only when the vllm backend is built (it lives in its own environment on GPU boxes).
"""

from __future__ import annotations

from typing import Any

from stages.core.registry import Registry
from stages.generation.base import (
    FINISH_REASONS,
    ForwardStats,
    GenerationBackend,
    GenRequest,
    GenResult,
    SamplingSpec,
)

BACKENDS: Registry = Registry("generation backend")


@BACKENDS.register("transformers")
def _transformers(model: Any, tokenizer: Any, **opts: Any) -> GenerationBackend:
    from stages.generation.hf import TransformersBackend

    return TransformersBackend(model, tokenizer, **opts)


@BACKENDS.register("vllm")
def _vllm(model: Any, tokenizer: Any, **opts: Any) -> GenerationBackend:
    from stages.generation.vllm_backend import VLLMBackend

    return VLLMBackend(model, tokenizer, **opts)


def load_backend(name: str, model: Any, tokenizer: Any, **opts: Any) -> GenerationBackend:
    """Build the generation backend `name` ("transformers" | "vllm") over the trainer's model and tokenizer."""
    return BACKENDS.get(name)(model, tokenizer, **opts)


__all__ = ["BACKENDS", "FINISH_REASONS", "ForwardStats", "GenRequest", "GenResult", "GenerationBackend",
           "SamplingSpec", "load_backend"]
