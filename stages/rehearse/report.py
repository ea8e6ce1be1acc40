"""The rehearsal report (`rehearsal.md` + `rehearsal.json` in the run record): what was changed and why, each seam
check, the real-scale estimate, and per stage whether it ran in this rehearsal and for how long."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.core.atomic import write_json, write_text
from stages.rehearse.rule import Rehearsal

MARKER = "_COMPLETE.json"


def stage_marker(path: str | Path, depth: int = 4) -> dict[str, Any] | None:
    """The completion marker of the stage folder that holds `path` (a model folder, a checkpoint, a file)."""
    folder = Path(path)
    for candidate in [folder, *folder.parents][:depth + 1]:
        marker = candidate / MARKER
        if marker.is_file():
            return json.loads(marker.read_text())
    return None


def stage_timings(refs: dict[str, Any], started_at: float) -> list[dict[str, Any]]:
    """Per stage of the run's refs: ran in this rehearsal (finished after `started_at`) or came from an earlier
    run's outputs, and the wall time between its finish and the previous stage's (the stages run one after the
    other, so that is the stage's time, its Prefect bookkeeping included)."""
    rows = []
    for name, ref in refs.items():
        first = ref[0] if isinstance(ref, list) and ref else ref
        if not isinstance(first, dict):
            continue
        marker = stage_marker(first.get("path", "")) if first.get("path") else None
        finished = marker.get("finished_at") if marker else None
        rows.append({"stage": name, "path": first.get("path") or first.get("url", ""),
                     "finished_at": finished, "ran": bool(finished and finished >= started_at)})
    previous = started_at
    for row in sorted((r for r in rows if r["ran"]), key=lambda r: r["finished_at"]):
        row["seconds"] = round(row["finished_at"] - previous, 1)
        previous = row["finished_at"]
    return rows


def write_report(run_dir: str | Path, rehearsal: Rehearsal, seams: list[Any] | None, real_scale: dict[str, Any],
                 timings: list[dict[str, Any]], wall_s: float) -> Path:
    """Write rehearsal.json and rehearsal.md into the run record; returns the markdown's path."""
    run_dir = Path(run_dir)
    seam_rows = [{"check": s.name, "ok": s.ok, "detail": s.detail} for s in seams or []]
    write_json(run_dir / "rehearsal.json", {**rehearsal.to_json(), "seam_checks": seam_rows,
                                            "real_scale": real_scale, "stages": timings, "wall_s": round(wall_s, 1)})
    lines = [f"# Rehearsal of {rehearsal.profile}", "",
             "**A rehearsal, not a run of the profile**: a random-init toy model of the profile's architecture with its "
             "real tokenizer, at toy scale, with the swaps below. Its scores mean nothing; what it shows is that every "
             "stage of this profile runs and fits together.", "",
             f"Wall time: {wall_s / 60:.1f} min.", "", "## Stages", "", "| stage | ran here | time | output |",
             "|---|---|---|---|"]
    for row in timings:
        took = f"{row['seconds']:.0f} s" if "seconds" in row else ("earlier run's output" if not row["ran"] else "")
        lines.append(f"| {row['stage']} | {'yes' if row['ran'] else 'no (cached)'} | {took} | `{row['path']}` |")
    lines += ["", "## Seam checks (docs/seams.md)", ""]
    if seam_rows:
        lines += ["| check | result | detail |", "|---|---|---|"]
        lines += [f"| {r['check']} | {'ok' if r['ok'] else 'FAILED'} | {r['detail']} |" for r in seam_rows]
    else:
        lines.append("not run (no stage that reads the tokenizer was planned)")
    lines += ["", "## At the profile's real scale", ""]
    lines += [f"- {key}: {value}" for key, value in real_scale.items()] or ["(no estimate)"]
    lines += ["", "## What the rehearsal changed (stages/rehearse/rule.py)", "", rehearsal.table(), ""]
    path = run_dir / "rehearsal.md"
    write_text(path, "\n".join(lines))
    return path
