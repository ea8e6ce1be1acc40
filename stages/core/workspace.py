"""Where stage outputs live: one content-addressed folder per (stage, cache key).

A folder is complete when its `_COMPLETE.json` marker exists; the marker holds the build id that goes into
the output ref's fingerprint. A crashed stage leaves no marker, so the next run resumes inside the folder
(stages with checkpoints pick them up) or starts over. `force=True` wipes the folder first.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.atomic import write_json
from stages.core.fingerprint import hash_path, hash_value

MARKER = "_COMPLETE.json"


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
        """Write the completion marker; return the fingerprint (content hash + build id)."""
        content_hash = hash_path(content or self.path, exclude=(MARKER,))
        build_id = uuid.uuid4().hex[:12]
        fingerprint = hash_value(self.key, content_hash, build_id)
        write_json(self.path / MARKER, {"key": self.key, "content": content_hash, "build_id": build_id,
                                        "fingerprint": fingerprint, "finished_at": time.time(), **info})
        return fingerprint

    @property
    def fingerprint(self) -> str:
        return self.marker()["fingerprint"]


def stage_dir(root: str | Path, stage: str, key: str, force: bool = False) -> StageDir:
    path = Path(root).resolve() / stage / key
    if force and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return StageDir(path=path, key=key)
