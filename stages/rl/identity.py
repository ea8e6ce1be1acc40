"""What the trained weights of an RL run depend on (`training_identity`): read by the stage key (stages.rl.stage.rl_key)
and by each engine's checkpoints (stages.rl.trainer), so computing the key imports no trainer."""

from __future__ import annotations

from typing import Any

from stages.core.config.rl import RLSection


def training_identity(cfg: RLSection) -> dict[str, Any]:
    """What the trained weights depend on: the RL section without the watching settings (alarm thresholds and
    stop list, artifact refresh, the card's reference run, the launcher's stall watchdog), so changing those neither
    recomputes the stage nor refuses its checkpoints."""
    return cfg.model_dump(mode="json", exclude={"alarms": True, "reference_setting": True,
                                                "trainer": {"report_every"}, "verl": {"stall_timeout_s"}})
