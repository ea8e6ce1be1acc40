"""Tool-result cache shared by RL rollouts, SFT and evaluation: the one SQLite store (stages/core/store.py), many
processes.

Key = sha256 of (tool, tool version, normalised argument, backend + corpus id), so a result is reused only for
the same tool code answering from the same data. Hit/miss/write counters are kept per instance (`stats()`), and
the file's row count is available too.

On a network filesystem (NFS, Lustre, ...: `stages.core.store.network_filesystem`), the easy way to give every Ray
node the same `cache_root`, the file is per host (`tool_cache.<host>.sqlite`) and uses the rollback journal: WAL's
shared-memory index works only among processes of one host, and SQLite's locks over NFS are only as good as its
lock daemon, so no two hosts write one file.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from stages.core.store import MOUNTS, SQLiteStore, network_filesystem, store_key


def cache_key(tool: str, tool_version: str, argument: str, backend: str) -> str:
    return store_key(tool, tool_version, argument, backend)


def host_path(path: str | Path, mounts: str | Path = MOUNTS) -> Path:
    """`path`, or on a network filesystem its per-host name: `tool_cache.sqlite` -> `tool_cache.<host>.sqlite`."""
    path = Path(path)
    if network_filesystem(path.parent, mounts) is None:
        return path
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"
    return path.with_name(f"{path.stem}.{host}{path.suffix}")


class ToolCache(SQLiteStore):
    """`get(tool, version, argument, backend) -> dict | None`, `put(..., value)`."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 60.0, mounts: str | Path = MOUNTS) -> None:
        super().__init__(host_path(path, mounts), "tool_results", busy_timeout_s, mounts)

    def get(self, tool: str, tool_version: str, argument: str, backend: str) -> dict[str, Any] | None:  # type: ignore[override]
        return super().get(cache_key(tool, tool_version, argument, backend))

    def put(self, tool: str, tool_version: str, argument: str, backend: str,  # type: ignore[override]
            value: dict[str, Any]) -> None:
        super().put(cache_key(tool, tool_version, argument, backend), value, note=f"{tool} [{backend}]: {argument}")
