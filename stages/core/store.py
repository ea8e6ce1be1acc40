"""The one SQLite store: a key -> JSON value table in one file, shared by threads and processes.

Used by the tool-result cache (stages/agent/cache.py) and the judge's verdicts (stages/eval/judge.py). WAL journal
and a busy timeout make concurrent writers from several processes safe; a write is one `INSERT OR REPLACE`
transaction. WAL needs every process on one host (its index is shared memory; sqlite.org/wal.html: "WAL does not
work over a network filesystem"), so on a network filesystem (`network_filesystem`, read from /proc/mounts) the
store uses the rollback journal (`journal_mode = DELETE`) instead. Values are JSON stored as UTF-8 with
`surrogatepass`, so every Python string comes back exactly (a lone surrogate a model wrote included; JSON's \\u
escapes would join a high and a low surrogate into one character). `note` is a column for people reading the
file. Hit/miss/write counters are per instance.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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


MOUNTS = "/proc/mounts"
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs", "ocfs2",
    "gfs2", "fuse.glusterfs", "fuse.sshfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "fuse.cephfs",
    "fuse.weka", "wekafs", "fuse.rclone"})


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | Path, mounts: str | Path = MOUNTS) -> str | None:
    """The type of the filesystem holding `path` (which need not exist yet): the mount with the longest mount
    point above its real path; None when `mounts` cannot be read (not Linux)."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fields[2]
    return kind


def network_filesystem(path: str | Path, mounts: str | Path = MOUNTS) -> str | None:
    """The filesystem type when `path` is on a network (shared) filesystem, else None."""
    kind = filesystem_type(path, mounts)
    return kind if kind in NETWORK_FILESYSTEMS else None


def _retry_locked(statement, timeout_s: float) -> None:
    """Run `statement` until it does not fail with "database is locked" (or `timeout_s` has passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            statement()
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SQLiteStore:
    def __init__(self, path: str | Path, table: str, busy_timeout_s: float = 60.0, mounts: str | Path = MOUNTS) \
            -> None:
        if not table.isidentifier():
            raise ValueError(f"table name {table!r} must be an identifier")
        self.path, self.table = Path(path), table
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, check_same_thread=False,
                                     isolation_level=None)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        self.shared_fs = network_filesystem(self.path.parent, mounts)
        self.journal_mode = "DELETE" if self.shared_fs else "WAL"
        # Two processes opening a new file at once: switching it to WAL needs the exclusive lock, and SQLite can
        # answer SQLITE_BUSY there without calling the busy handler ("database is locked" at once), so retry.
        _retry_locked(lambda: self._conn.execute(f"PRAGMA journal_mode = {self.journal_mode}"), busy_timeout_s)
        self._conn.execute("PRAGMA synchronous = NORMAL")
        _retry_locked(lambda: self._conn.execute(
            f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, value BLOB NOT NULL, note TEXT NOT NULL, "
            "created REAL NOT NULL)"), busy_timeout_s)
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

    def check_writable(self) -> None:
        """Raise sqlite3.Error unless this process can take the file's write lock (writes nothing)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("ROLLBACK")

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
