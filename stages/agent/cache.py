"""Tool-result cache shared by RL rollouts, SFT and evaluation: the one SQLite store (stages/core/store.py), many
processes.

Key = sha256 of (tool, tool version, normalised argument, backend + corpus id), so a result is reused only for
the same tool code answering from the same data. Hit/miss/write counters are kept per instance (`stats()`), and
the file's row count is available too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core.store import SQLiteStore, store_key


def cache_key(tool: str, tool_version: str, argument: str, backend: str) -> str:
    return store_key(tool, tool_version, argument, backend)


class ToolCache(SQLiteStore):
    """`get(tool, version, argument, backend) -> dict | None`, `put(..., value)`."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 60.0) -> None:
        super().__init__(path, "tool_results", busy_timeout_s)

    def get(self, tool: str, tool_version: str, argument: str, backend: str) -> dict[str, Any] | None:  # type: ignore[override]
        return super().get(cache_key(tool, tool_version, argument, backend))

    def put(self, tool: str, tool_version: str, argument: str, backend: str,  # type: ignore[override]
            value: dict[str, Any]) -> None:
        super().put(cache_key(tool, tool_version, argument, backend), value, note=f"{tool} [{backend}]: {argument}")
