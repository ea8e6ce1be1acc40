"""Keep every cache and state folder inside the project, and the run offline by default.

Prefect, Hugging Face, Ray and matplotlib all write under `~` unless told otherwise (measured: docs/decisions.md,
"State stays inside the project"); this sets their variables before any of them is imported. Values the
user already exported win.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def local_environment(project_root: Path = PROJECT_ROOT, cache_root: str | Path = ".cache") -> dict[str, str]:
    root = Path(project_root).resolve()
    cache = (root / cache_root).resolve()
    prefect = root / ".prefect"
    return {
        "HF_HOME": str(cache / "hf"),
        "HF_HUB_CACHE": str(cache / "hf" / "hub"),
        "HF_DATASETS_CACHE": str(cache / "hf" / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLCONFIGDIR": str(cache / "mpl"),
        "PREFECT_HOME": str(prefect),
        "PREFECT_LOCAL_STORAGE_PATH": str(prefect / "storage"),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(prefect / "storage"),
        "PREFECT_MEMO_STORE_PATH": str(prefect / "memo_store.toml"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
        # flow runs beat every 30 s; the server marks one silent for longer Crashed (flows/automations.py)
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
        # a run without a server starts an ephemeral one; on a loaded 2-core box that takes longer than 20 s
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": str(Path("/tmp") / f"arpo-ray-{os.getuid()}"),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "DISABLE_VERSION_CHECK": "1",
        "WANDB_DISABLED": "true",
        "WANDB_MODE": "disabled",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),          # torch.compile artifacts, assets
        "VLLM_CONFIG_ROOT": str(cache / "vllm-config"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }


def configure_environment(project_root: Path = PROJECT_ROOT, cache_root: str | Path = ".cache") -> dict[str, str]:
    """Set the variables above unless already set; create the folders. Returns what is in effect."""
    applied = {}
    for key, value in local_environment(project_root, cache_root).items():
        os.environ.setdefault(key, value)
        applied[key] = os.environ[key]
    for key in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "MPLCONFIGDIR", "PREFECT_HOME"):
        Path(applied[key]).mkdir(parents=True, exist_ok=True)
    return applied


def free_cpu_threads() -> int:
    """Cores not busy right now (load average), at least 1: two threads on a loaded 2-core box are slower
    than one (docs/decisions.md, "The tiny model")."""
    cores = len(os.sched_getaffinity(0))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, min(cores, round(cores - load)))
