"""Where stage outputs live: one content-addressed folder per (stage, cache key).

A folder is complete when its `_COMPLETE.json` marker exists; the marker holds the build id that goes into the
output ref's fingerprint, and `_MANIFEST.json` beside it lists every file with its size and sha256
(stages/core/manifest.py). A crashed stage leaves no marker, so the next run resumes inside the folder (stages with
checkpoints pick them up) or starts over. `force=True` wipes the folder first.

A complete folder is checked before it is reused (`verify`): one whose files vanished, shrank or changed is
recomputed, with a warning naming the files, never handed on. One builder at a time: `stage_dir` holds the folder's
lock (stages/core/locks.py) while a stage builds it, so a second run started on the same outputs waits and then
reuses what the first built.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core import locks, manifest
from stages.core.atomic import write_json
from stages.core.fingerprint import hash_path, hash_value
from stages.core.log import get_logger

MARKER = "_COMPLETE.json"
log = get_logger(__name__)


@dataclass(frozen=True)
class StageDir:
    path: Path
    key: str

    @property
    def complete(self) -> bool:
        return (self.path / MARKER).is_file()

    def marker(self) -> dict[str, Any]:
        return json.loads((self.path / MARKER).read_text())

    def finish(self, content: Path | None = None, **info: Any) -> str:
        """Write the manifest, then the completion marker; return the fingerprint (content hash + build id)."""
        entries = manifest.build(self.path, exclude=(MARKER,))
        manifest.write(self.path, entries)
        content_hash = _content_hash(self.path, Path(content) if content else self.path, entries)
        build_id = uuid.uuid4().hex[:12]
        fingerprint = hash_value(self.key, content_hash, build_id)
        write_json(self.path / MARKER, {"key": self.key, "content": content_hash, "build_id": build_id,
                                        "fingerprint": fingerprint, "finished_at": time.time(), **info})
        locks.release(self.path)
        return fingerprint

    @property
    def fingerprint(self) -> str:
        return self.marker()["fingerprint"]


def _content_hash(folder: Path, content: Path, entries: dict[str, dict[str, Any]]) -> str:
    """Hash of `content` (a file or folder), from the manifest's sha256 where it lies inside the stage folder."""
    if not content.resolve().is_relative_to(folder.resolve()):
        return hash_path(content, exclude=(MARKER, manifest.MANIFEST))
    rel = content.resolve().relative_to(folder.resolve())
    if content.is_file():
        return entries[str(rel)]["sha256"][:16]
    inside = sorted((Path(name).relative_to(rel), entry["sha256"]) for name, entry in entries.items()
                    if Path(name).is_relative_to(rel))
    return hash_value([[str(name), digest] for name, digest in inside])


def stage_path(root: str | Path, stage: str, key: str) -> Path:
    return Path(root).resolve() / stage / key


def verify(path: Path, full: bool = False) -> list[str]:
    """Problems of a complete folder (vanished / shrunk / changed files, each named); [] when it is intact or not
    complete (nothing to hand on)."""
    if not (path / MARKER).is_file():
        return []
    return manifest.check(path, full=full)


def discard_if_damaged(path: Path, stage: str, full: bool = False) -> bool:
    """Wipe a complete folder that fails `verify`, warning with the files; True when it did."""
    problems = verify(path, full)
    if not problems:
        return False
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    log.warning("cached output of stage %s is damaged, recomputing it: %s (in %s)", stage, shown, path)
    shutil.rmtree(path)
    return True


def stage_dir(root: str | Path, stage: str, key: str, force: bool = False) -> StageDir:
    """The stage's folder, ready to build in (its lock held) or complete and checked (lock released)."""
    path = stage_path(root, stage, key)
    locks.acquire(path)
    try:
        if force and path.exists():
            shutil.rmtree(path)
        else:
            discard_if_damaged(path, stage)
        path.mkdir(parents=True, exist_ok=True)
    except BaseException:
        locks.release(path)
        raise
    out = StageDir(path=path, key=key)
    if out.complete:
        locks.release(path)  # nothing to build: other runs may read it now
    return out
