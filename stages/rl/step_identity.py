"""What one RL step costs is decided by: `step_identity.json` in every RL stage folder.

A hash of everything that decides what one step costs (the RL section without its step count, checkpointing, alarms
and optimizer; the agent; the base model and dtype). A short run of a configuration (fewer steps) has the identity of
the full one, so `arpo plan` (stages.cost.basis) projects the full run from it. It lives with the RL stage that
writes it: the planner reads RL's folders, the RL stage never imports the planner (its key would cover it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core.atomic import write_json
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.fingerprint import hash_value

IDENTITY_FILE = "step_identity.json"
NOT_PER_STEP: dict[str, Any] = {"alarms": True, "optim": True, "enabled": True, "trainer": {
    "total_steps", "epochs", "save_every", "report_every", "keep_checkpoints", "keep_optimizer_state",
    "dump_rollouts"}}


def step_identity(rl: RLSection, agent: AgentSection, model_name: str, dtype: str) -> str:
    """Equal for two configurations whose steps cost the same (up to the policy's own behaviour)."""
    return hash_value(rl.model_dump(mode="json", exclude=NOT_PER_STEP), agent, model_name, dtype)


def write_identity(stage: Path, identity: str) -> None:
    if not (stage / IDENTITY_FILE).is_file():
        write_json(stage / IDENTITY_FILE, {"identity": identity})
