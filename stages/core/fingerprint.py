"""Content fingerprints for files, directories and JSON-able values.

A stage's cache key is hash(its config section, its input refs' fingerprints, the code version of the modules it
runs (stages.core.codeversion)), so the same function computes the Prefect cache key and the stage's output folder
name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

_CHUNK = 1 << 20
_SKIP_NAMES = {"__pycache__", ".DS_Store"}


def stable_json(value: Any) -> str:
    """Canonical JSON (sorted keys, no whitespace) of pydantic models, dicts, lists and scalars."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def hash_value(*values: Any, length: int = 16) -> str:
    """Short sha256 over the canonical JSON of the values."""
    return hashlib.sha256(stable_json(list(values)).encode()).hexdigest()[:length]


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_path(path: str | Path, exclude: tuple[str, ...] = ()) -> str:
    """Fingerprint of a file or of a directory tree (relative names + contents), sorted for stability."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"cannot fingerprint {root}: it does not exist")
    if root.is_file():
        return hash_file(root)[:16]
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root)
        if any(part in _SKIP_NAMES for part in rel.parts) or rel.name in exclude:
            continue
        digest.update(str(rel).encode())
        digest.update(hash_file(file).encode())
    return digest.hexdigest()[:16]
