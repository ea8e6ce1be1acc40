"""Where a stage's output came from, as the stage records it when it does the work: the checkout's commit (and
whether tracked files differed from it), the stage and key of a folder another stage wrote (its completion marker),
and the time. The evaluation's provenance block is built from these records (stages/eval/provenance.py).

    git_state()          # {"commit": "870c25e", "dirty": False}; None for each when git cannot tell
    stage_of(path)       # {"stage": "merge", "key": "3f2a..."} for a path inside a complete stage folder, else None
    utc_now()            # "2026-05-04T12:00:00Z"
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

from stages.core.env import PROJECT_ROOT
from stages.core.workspace import MARKER

NOT_RECORDED = "not recorded"  # how a record that is missing (made before it was kept) reads


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "--no-optional-locks", *args], cwd=root, capture_output=True, text=True,
                             timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_state(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """The checkout's short commit and whether tracked files differ from it (`dirty`); None when git cannot tell
    (no git, not a checkout). `--no-optional-locks`: reading never takes the index lock another process may want."""
    commit = _git(root, "rev-parse", "--short", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit or None, "dirty": None if status is None else bool(status)}


def stage_of(path: str | Path, levels: int = 3) -> dict[str, str] | None:
    """The stage and key of the complete stage folder holding `path` (the folder itself or up to `levels` above
    it), read from its completion marker; None for a path no stage wrote (a hub id, a model folder of yours)."""
    here = Path(path)
    for folder in [f for f in (here, *here.parents) if f.name][: levels + 1]:  # never "." or "/" themselves
        marker = folder / MARKER
        if marker.is_file():
            try:
                key = json.loads(marker.read_text(encoding="utf-8"))["key"]
            except (OSError, ValueError, KeyError):
                return None
            return {"stage": folder.parent.name, "key": str(key)}
    return None


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
