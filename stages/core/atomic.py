"""Atomic writes: readers see the old file or the new file, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from stages.core.errors import BadInputError


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success rename it over `target` (file or directory)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if target.is_dir() and tmp.is_dir():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_text(target: str | Path, text: str) -> Path:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def save_figure(fig: Any, png: str | Path, dpi: int = 90) -> Path:
    """Save a matplotlib figure as the PNG `png` atomically (a reader never sees half a file: the UI and the tracker
    read the curves while a run writes them), then close it."""
    import matplotlib.pyplot as plt

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(f".{png.name}.tmp.png")  # matplotlib picks the format from the suffix
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return png


def write_json(target: str | Path, value: Any, indent: int | None = 2) -> Path:
    return write_text(target, json.dumps(value, indent=indent, ensure_ascii=False, default=str) + "\n")


def write_yaml(target: str | Path, value: Any) -> Path:
    return write_text(target, yaml.safe_dump(value, sort_keys=False, allow_unicode=True))


def write_jsonl(target: str | Path, rows: list[dict[str, Any]]) -> Path:
    return write_text(target, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def iter_json_objects(path: str | Path, label: str = "", errors: str = "strict") -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line of a JSONL file; a line that is not one JSON object
    raises naming `label` (the config key that points here, if any), the file and the line."""
    prefix = f"{label}: " if label else ""
    with open(path, encoding="utf-8", errors=errors) as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise BadInputError(f"{prefix}{path}:{lineno}: not valid JSON ({err.msg}); it must hold one JSON "
                                    "object per line (fix or delete that line)") from err
            if not isinstance(row, dict):
                raise BadInputError(f"{prefix}{path}:{lineno}: expected a JSON object per line, got "
                                    f"{type(row).__name__}")
            yield lineno, row


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file; a bad line raises with the file name and 1-based line number."""
    path = Path(path)
    rows = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise BadInputError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or delete that line") from err
    return rows
