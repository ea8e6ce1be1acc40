"""What a finished stage folder holds, and whether it still holds it.

A stage writes `_MANIFEST.json` with its completion marker: every file of its folder with its size, modification
time and sha256. Before a cached folder is handed on, `check` compares the folder with it:
- `quick` (every cache hit): the size of every file, the content of every small file (<= CHEAP_BYTES) and of every
  file whose modification time moved; a same-size, same-time change of a large file goes unseen;
- `full` (`arpo run --verify`): the content of every file.
A vanished file, a changed size or changed content is a problem naming the file. A file whose time moved but whose
content is unchanged (a copy, a `touch`) gets its new time recorded, so it is not hashed on every hit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.core.atomic import write_json
from stages.core.fingerprint import hash_file

MANIFEST = "_MANIFEST.json"
CHEAP_BYTES = 1 << 20
_SKIP_PARTS = {"__pycache__", ".DS_Store"}


def files_of(folder: Path, exclude: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in exclude
                  and not _SKIP_PARTS & set(p.relative_to(folder).parts))


def build(folder: Path, exclude: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """{relative name: {size, mtime_ns, sha256}} of every file under `folder`."""
    entries = {}
    for file in files_of(folder, exclude + (MANIFEST,)):
        stat = file.stat()
        entries[str(file.relative_to(folder))] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                                  "sha256": hash_file(file)}
    return entries


def write(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    write_json(folder / MANIFEST, {"version": 1, "files": entries}, indent=None)


def load(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The recorded files, or None for a folder finished before manifests existed (or with an unreadable one)."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        return dict(data["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(folder: Path, full: bool = False) -> list[str]:
    """Problems of a finished folder against its manifest, each naming the file (empty: it is as it was written)."""
    entries = load(folder)
    if entries is None:
        return [] if not (folder / MANIFEST).exists() else [f"{MANIFEST} is unreadable"]
    problems: list[str] = []
    moved: dict[str, int] = {}
    for name, entry in entries.items():
        problem, mtime = _check_file(folder / name, entry, full)
        if problem:
            problems.append(f"{name}: {problem}")
        elif mtime is not None:
            moved[name] = mtime
    if moved and not problems:  # same content, new time (copied, touched): remember it, hash it once
        write(folder, {name: {**entry, "mtime_ns": moved.get(name, entry["mtime_ns"])}
                       for name, entry in entries.items()})
    return problems


def _check_file(path: Path, entry: dict[str, Any], full: bool) -> tuple[str | None, int | None]:
    """(problem or None, the new mtime when it moved and the content is unchanged)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return "vanished", None
    if stat.st_size != entry["size"]:
        return f"is {stat.st_size:,} bytes, {entry['size']:,} when the stage wrote it (truncated or replaced)", None
    moved = stat.st_mtime_ns != entry["mtime_ns"]
    if full or moved or stat.st_size <= CHEAP_BYTES:
        if hash_file(path) != entry["sha256"]:
            return "content changed since the stage wrote it (same size, different sha256)", None
    return None, stat.st_mtime_ns if moved else None
