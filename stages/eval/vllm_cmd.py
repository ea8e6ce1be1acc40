"""The `vllm serve` command line for the `vllm` backend (pure, so it is tested without a GPU).

vLLM pins a torch and transformers that clash with LLaMA-Factory's, so it runs from its own environment:
`serve.vllm.executable` names that environment's `vllm` CLI (research/feasibility.md section 6).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stages.core.config.serve import ServeSection


class ServeError(RuntimeError):
    """A server could not be started or reached; the message says why and what to change."""


def vllm_command(cfg: ServeSection, model_path: str, served_name: str, port: int) -> list[str]:
    """`vllm serve <model> --host .. --port .. --served-model-name .. -tp .. ...` plus `vllm.extra_args`."""
    v = cfg.vllm
    return [v.executable, "serve", str(model_path),
            "--host", cfg.host, "--port", str(port),
            "--served-model-name", served_name,
            "--tensor-parallel-size", str(v.tensor_parallel_size),
            "--gpu-memory-utilization", str(v.gpu_memory_utilization),
            "--max-model-len", str(v.max_model_len),
            *v.extra_args]


def resolve_executable(executable: str) -> str:
    """The vLLM CLI as an absolute path, or a ServeError that says how to install it."""
    found = shutil.which(executable)
    if found is None and Path(executable).is_file() and os.access(executable, os.X_OK):
        found = str(Path(executable).resolve())
    if found is None:
        raise ServeError(
            f"serve.vllm.executable={executable!r} is not an executable on PATH or on disk. vLLM clashes with "
            "LLaMA-Factory's pins, so install it in its own environment (python -m venv .venv-vllm && "
            ".venv-vllm/bin/pip install vllm) and set serve.vllm.executable=.venv-vllm/bin/vllm, or use "
            "serve.backend=cpu (no GPU) or serve.backend=external with serve.url.")
    return found
