from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section


class VLLMSection(Section):
    executable: str = Field("vllm", description="vllm CLI from its own environment (pins clash with LLaMA-Factory)")
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.75
    max_model_len: int = 32768
    extra_args: list[str] = Field(default_factory=list)


class ServeSection(Section):
    """How a model is put behind an OpenAI-compatible endpoint."""

    backend: Literal["cpu", "vllm", "external"] = "cpu"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, description="0 = pick a free port")
    served_name: str | None = Field(None, description="model name clients send; None = the model's name")
    startup_timeout_s: float = 600.0
    max_batch_size: int = Field(8, ge=1, description="cpu backend: requests batched per generate call")
    url: str | None = Field(None, description="backend=external: base URL ending in /v1")
    api_key_env: str | None = Field(None, description="backend=external: env var holding the API key")
    vllm: VLLMSection = VLLMSection()
