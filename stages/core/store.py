"""The one SQLite store: a key -> JSON value table in one file, shared by threads and processes.

Used by the tool-result cache (stages/agent/cache.py) and the judge's verdicts (stages/eval/judge.py). WAL journal
and a busy timeout make concurrent writers from several processes safe; a write is one `INSERT OR REPLACE`
transaction. Values are JSON stored as UTF-8 with `surrogatepass`, so every Python string comes back exactly (a
lone surrogate a model wrote included; JSON's \\u escapes would join a high and a low surrogate into one
character). `note` is a column for people reading the file. Hit/miss/write counters are per instance.
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


def store_key(*parts: Any) -> str:
    """sha256 of the parts. `surrogatepass` encodes any Python string, a lone surrogate included, one-to-one."""
    return hashlib.sha256(stable_json(list(parts)).encode("utf-8", "surrogatepass")).hexdigest()


def _readable(text: str) -> str:
    """SQLite text columns are UTF-8 only: lone surrogates become `\\udxxx` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class SQLiteStore:
    def __init__(self, path: str | Path, table: str, busy_timeout_s: float = 60.0) -> None:
        if not table.isidentifier():
            raise ValueError(f"table name {table!r} must be an identifier")
        self.path, self.table = Path(path), table
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, check_same_thread=False,
                                     isolation_level=None)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, value BLOB NOT NULL, "
                           "note TEXT NOT NULL, created REAL NOT NULL)")
        self.hits = self.misses = self.writes = 0

    def get(self, key: str) -> Any | None:
        with self._lock:
            row = self._conn.execute(f"SELECT value FROM {self.table} WHERE key = ?", (key,)).fetchone()
            if row is None:
                self.misses += 1
                return None
            self.hits += 1
        value = row[0]
        return json.loads(value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value)

    def put(self, key: str, value: Any, note: str = "") -> None:
        payload = json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
        with self._lock:
            self._conn.execute(f"INSERT OR REPLACE INTO {self.table} (key, value, note, created) VALUES (?, ?, ?, ?)",
                               (key, payload, _readable(note), time.time()))
            self.writes += 1

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute(f"SELECT COUNT(*) FROM {self.table}").fetchone()[0])

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
