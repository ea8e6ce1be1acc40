"""A run record: one folder per pipeline run with its resolved config, the refs it produced and a summary."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from stages.core.atomic import write_json, write_text
from stages.core.config.loader import RunConfig, to_yaml


def start_run(cfg: RunConfig, stages: str, run_id: str | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.output_root).resolve() / "runs" / f"{cfg.run.name}-{stamp}-{(run_id or '')[:8]}".rstrip("-")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", f"# profile: {cfg.profile}\n# stages: {stages}\n" + to_yaml(cfg))
    point_latest(run_dir)
    return run_dir


def point_latest(run_dir: Path) -> None:
    """`runs/latest` -> this run, replaced atomically (two runs started at once each leave a valid link)."""
    tmp = run_dir.parent / f".latest-{uuid.uuid4().hex[:8]}"
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, run_dir.parent / "latest")


def finish_run(run_dir: str | Path, refs: dict[str, Any]) -> dict[str, Any]:
    """Write refs.json (every stage output) and summary.md; return the summary dict."""
    run_dir = Path(run_dir)
    plain = {name: _plain(ref) for name, ref in refs.items() if ref is not None}
    write_json(run_dir / "refs.json", plain)
    lines = [f"# Run {run_dir.name}", "", "| stage | output | fingerprint |", "|---|---|---|"]
    for name, ref in plain.items():
        items = ref if isinstance(ref, list) else [ref]
        for item in items:
            lines.append(f"| {name} | `{item.get('path') or item.get('url', '')}` | {item.get('fingerprint', '')} |")
    write_text(run_dir / "summary.md", "\n".join(lines) + "\n")
    return {"run_dir": str(run_dir), "refs": plain}


def _plain(ref: Any) -> Any:
    if isinstance(ref, BaseModel):
        return ref.model_dump(mode="json")
    if isinstance(ref, (list, tuple)):
        return [_plain(r) for r in ref]
    if isinstance(ref, dict):
        return {k: _plain(v) for k, v in ref.items()}
    return ref
