"""Keep every cache and state folder inside the project, and the run offline by default.

Prefect, Hugging Face, Ray and matplotlib all write under `~` unless told otherwise (measured: docs/decisions.md,
"State stays inside the project"); this sets their variables before any of them is imported. Values the
user already exported win.
"""

from __future__ import annotations

import functools
import os
import tomllib
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def prefect_settings() -> dict:
    """The project's prefect.toml, what `prefect` reads in this folder: the one statement of the server's URL (its
    port), Prefect's home, the flow runs' heartbeat and the log batching. Code reads them from here (a process
    started outside the folder does not read the file, so `local_environment` passes them on)."""
    return tomllib.loads((PROJECT_ROOT / "prefect.toml").read_text(encoding="utf-8"))


def local_environment(project_root: Path = PROJECT_ROOT, cache_root: str | Path = ".cache") -> dict[str, str]:
    root = Path(project_root).resolve()
    cache = (root / cache_root).resolve()
    toml = prefect_settings()
    prefect = root / toml["home"]
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
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": str(toml["logging"]["to_api"]["batch_interval"]),
        # flow runs beat at prefect.toml's rate wherever they start; the server marks a silent one Crashed
        # (flows/automations.py)
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(toml["flows"]["heartbeat_frequency"]),
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


DATABASE_URL_KEYS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def ephemeral_database_env(prefect_home: str | Path, pid: int, environ: dict[str, str] | None = None
                           ) -> dict[str, str]:
    """The database variables of a run's temporary Prefect server: an SQLite file of its own under
    `<PREFECT_HOME>/ephemeral/<pid>/`, not the `<PREFECT_HOME>/prefect.db` that `arpo server` serves from. Two
    servers writing one SQLite file end a run with "sqlite3.OperationalError: database is locked" (docs/caching.md,
    "The ephemeral server's database"). Only the run history moves: the result store
    (PREFECT_RESULTS_LOCAL_STORAGE_PATH) and the stage folders stay where they are, so a cached rerun still hits.
    A database the user configured that is not SQLite (PostgreSQL takes many writers) is kept: returns {}."""
    environ = os.environ if environ is None else environ
    configured = next((environ[key] for key in DATABASE_URL_KEYS if environ.get(key)), "")
    if configured and not configured.startswith("sqlite"):
        return {}
    url = f"sqlite+aiosqlite:///{ephemeral_database_dir(prefect_home, pid) / 'prefect.db'}"
    return dict.fromkeys(DATABASE_URL_KEYS, url)


def ephemeral_database_dir(prefect_home: str | Path, pid: int) -> Path:
    return Path(prefect_home).resolve() / "ephemeral" / str(pid)


def prune_ephemeral_databases(prefect_home: str | Path) -> list[Path]:
    """Remove `<PREFECT_HOME>/ephemeral/<pid>/` folders whose process is gone (a run killed before its exit hook
    removed its own); returns them."""
    import shutil

    removed = []
    for folder in sorted((Path(prefect_home) / "ephemeral").glob("*")):
        if folder.name.isdigit() and not _alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
