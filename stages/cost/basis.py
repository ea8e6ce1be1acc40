"""The measured run a plan may project from.

Every RL stage folder gets `step_identity.json`: a hash of everything that decides what one step costs (the RL
section without its step count, checkpointing, alarms and optimizer; the agent; the base model and dtype). A
short run of a configuration (fewer steps) has the identity of the full one, so `arpo plan` projects the full
run from it. `read_measured` reads the per-step rows of metrics.jsonl (the local engine's names, or verl's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.atomic import read_jsonl, write_json
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.fingerprint import hash_value

IDENTITY_FILE = "step_identity.json"
METRICS_FILE = "metrics.jsonl"
NOT_PER_STEP: dict[str, Any] = {"alarms": True, "optim": True, "enabled": True, "trainer": {
    "total_steps", "epochs", "save_every", "report_every", "keep_checkpoints", "keep_optimizer_state",
    "dump_rollouts"}}
# our name -> the metric names that carry it (local engine first, then verl's file logger)
ALIASES: dict[str, tuple[str, ...]] = {
    "trajectories": ("rollout/trajectories",),
    "model_tokens_per_traj": ("response/model_tokens",),
    "response_tokens_per_traj": ("response/length", "response_length/mean"),
    "tool_calls": ("rollout/tool_calls_executed",),
    "search_calls": ("rollout/search_calls_executed",),
    "python_calls": ("rollout/python_calls_executed",),
    "step_s": ("timing/step_s", "timing_s/step"),
}


def step_identity(rl: RLSection, agent: AgentSection, model_name: str, dtype: str) -> str:
    """Equal for two configurations whose steps cost the same (up to the policy's own behaviour)."""
    return hash_value(rl.model_dump(mode="json", exclude=NOT_PER_STEP), agent, model_name, dtype)


def write_identity(stage: Path, identity: str) -> None:
    if not (stage / IDENTITY_FILE).is_file():
        write_json(stage / IDENTITY_FILE, {"identity": identity})


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
