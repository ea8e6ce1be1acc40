from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section


class VLLMSection(Section):
    executable: str = Field("vllm", description="vllm CLI from its own environment (pins clash with LLaMA-Factory)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per server (vllm --tensor-parallel-size)")
    gpu_memory_utilization: float = Field(0.75, gt=0, le=1, description="fraction of GPU memory vLLM may take")
    max_model_len: int = Field(32768, ge=1, description="context length (vllm --max-model-len)")
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to `vllm serve`")


class ServeSection(Section):
    """How a model is put behind an OpenAI-compatible endpoint."""

    backend: Literal["cpu", "vllm", "external"] = "cpu"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, description="0 = pick a free port")
    served_name: str | None = Field(None, description="model name clients send; None = the model's name")
    startup_timeout_s: float = 600.0
    max_batch_size: int = Field(8, ge=1, description="cpu backend: requests batched per generate call")
    batch_wait_ms: float = Field(20.0, ge=0, description="cpu backend: how long a batch waits for more requests")
    threads: int | None = Field(None, ge=1, description="cpu backend: torch threads; None = cores free at start")
    prefix_cache_entries: int = Field(8, ge=0, description="cpu backend: prompt prefixes whose KV cache is reused")
    sampling_extras: bool | None = Field(
        None, description="send vLLM's top_k/min_p/repetition_penalty; None = yes for cpu/vllm, no for external")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM -> SIGKILL wait when stopping the server")
    url: str | None = Field(None, description="backend=external: base URL ending in /v1")
    api_key_env: str | None = Field(None, description="backend=external: env var holding the API key")
    vllm: VLLMSection = VLLMSection()
