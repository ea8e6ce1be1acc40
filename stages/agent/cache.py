"""Tool-result cache shared by RL rollouts and evaluation: one SQLite file, many processes.

Key = sha256 of (tool, tool version, normalised argument, backend + corpus id), so a result is reused only for
the same tool code answering from the same data. WAL journal + busy timeout make concurrent writers from
several processes safe; a write is one `INSERT OR REPLACE` transaction. Hit/miss/write counters are kept per
instance (`stats()`), and the file's row count is available too.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Self

from stages.core.fingerprint import stable_json

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    argument TEXT NOT NULL,
    backend TEXT NOT NULL,
    value TEXT NOT NULL,
    created REAL NOT NULL
)
"""


def cache_key(tool: str, tool_version: str, argument: str, backend: str) -> str:
    """sha256 of the parts. `surrogatepass` encodes any Python string, a lone surrogate included, one-to-one."""
    return hashlib.sha256(stable_json([tool, tool_version, argument, backend]).encode("utf-8", "surrogatepass")
                          ).hexdigest()


def _storable(text: str) -> str:
    """SQLite stores UTF-8 only: lone surrogates become `\\udxxx` escapes (the column is for people to read)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ToolCache:
    """`get(...) -> dict | None`, `put(...)`; thread-safe within a process, WAL-safe across processes."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, check_same_thread=False,
                                     isolation_level=None)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.execute(SCHEMA)
        self.hits = self.misses = self.writes = 0

    def get(self, tool: str, tool_version: str, argument: str, backend: str) -> dict[str, Any] | None:
        key = cache_key(tool, tool_version, argument, backend)
        with self._lock:
            row = self._conn.execute("SELECT value FROM results WHERE key = ?", (key,)).fetchone()
            if row is None:
                self.misses += 1
                return None
            self.hits += 1
        value = row[0]
        return json.loads(value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value)

    def put(self, tool: str, tool_version: str, argument: str, backend: str, value: dict[str, Any]) -> None:
        key = cache_key(tool, tool_version, argument, backend)
        # UTF-8 bytes with surrogatepass: every Python string comes back exactly (JSON's \\u escapes would join a
        # high and a low surrogate into one character)
        payload = json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO results (key, tool, tool_version, argument, backend, value, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, tool, _storable(tool_version), _storable(argument), _storable(backend), payload, time.time()))
            self.writes += 1

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM results").fetchone()[0])

    def stats(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"cache_hits": float(self.hits), "cache_misses": float(self.misses),
                "cache_writes": float(self.writes), "cache_hit_rate": self.hits / lookups if lookups else 0.0}

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
