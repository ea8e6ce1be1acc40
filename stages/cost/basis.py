"""The measured run a plan may project from.

Every RL stage folder gets `step_identity.json` (stages.rl.step_identity: equal for a short run and the full one),
so `arpo plan` projects the full run from a short one.
`read_measured` reads the per-step rows of metrics.jsonl (the local engine's names, or verl's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.atomic import read_jsonl
from stages.rl.step_identity import IDENTITY_FILE

METRICS_FILE = "metrics.jsonl"

# our name -> the metric names that carry it (local engine first, then verl's file logger)
ALIASES: dict[str, tuple[str, ...]] = {
    "trajectories": ("rollout/trajectories",),
    "model_tokens_per_traj": ("response/model_tokens",),
    "response_tokens_per_traj": ("response/length", "response_length/mean"),
    "tool_calls": ("rollout/tool_calls_executed",),
    "search_calls": ("rollout/search_calls_executed",),
    "python_calls": ("rollout/python_calls_executed",),
    "step_s": ("timing/step_s", "timing_s/step"),
    "generate_s": ("timing/generate_s",),        # the rollout's split (stages/rl/step_metrics.py)
    "tools_s": ("timing/tools_s",),
    "tool_queue_s": ("timing/tool_queue_s",),
    "calls_per_round": ("tools/calls_per_round",),
}


@dataclass(frozen=True)
class Measured:
    """Per-step metric rows of a measured run."""

    source: str
    rows: list[dict[str, Any]]

    @property
    def steps(self) -> int:
        return len(self.rows)

    def mean(self, name: str) -> float | None:
        """Mean over the measured steps of the metric `name` (ALIASES), None when no step has it."""
        for key in ALIASES[name]:
            values = [float(r[key]) for r in self.rows if isinstance(r.get(key), (int, float))]
            if values:
                return sum(values) / len(values)
        return None


def read_measured(path: str | Path) -> Measured:
    """The rows of an RL stage folder's metrics.jsonl (or of that file itself)."""
    path = Path(path)
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no measured run at {path}: expected an RL stage folder with {METRICS_FILE} or the "
                                "file itself (cost.measured)")
    rows = read_jsonl(file)
    if not rows:
        raise ValueError(f"{file} has no steps yet; let the measured run finish at least one step")
    return Measured(str(file), rows)


def find_measured(output_root: str | Path, identity: str) -> Measured | None:
    """The newest RL stage folder under `output_root` with this identity and at least one finished step."""
    found = []
    for marker in Path(output_root).glob(f"rl/*/{IDENTITY_FILE}"):
        metrics = marker.parent / METRICS_FILE
        try:
            same = json.loads(marker.read_text()).get("identity") == identity
        except (OSError, json.JSONDecodeError):
            continue
        if same and metrics.is_file() and metrics.stat().st_size > 0:
            found.append((metrics.stat().st_mtime, marker.parent))
    return read_measured(max(found)[1]) if found else None
