"""What our verl plugin needs from the project config, in every Ray process verl starts.

verl hands plugins only its own (hydra) config, which has no place for our rollout tree, tool or advantage
settings. The launcher writes them once as JSON into the stage folder and points `ARPO_VERL_SETTINGS` at it; the
variable travels to every Ray worker through `ray_kwargs.ray_init.runtime_env.env_vars`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from pydantic import Field

from stages.core.atomic import write_json
from stages.core.config.agent import AgentSection
from stages.core.config.rl import AdvantageSection, AlarmSection, RolloutSection
from stages.core.config.section import Section

SETTINGS_ENV = "ARPO_VERL_SETTINGS"


class PluginSettings(Section):
    algorithm: str = Field(description="rl.algorithm: the strategy the trees grow by (its growth and branch rule)")
    rollout: RolloutSection = RolloutSection()
    agent: AgentSection = AgentSection()
    advantage: AdvantageSection = AdvantageSection()
    alarms: AlarmSection = Field(AlarmSection(), description="rl.alarms: the infra_failures alarm is checked in "
                                 "the advantage step (stages/rl/verl/advantage.py)")
    reward: str = "reference"
    seed: int = Field(0, description="run seed; trees are seeded from (seed, global step, dataset index)")
    corpus_path: str | None = None
    cache_root: str = ".cache"
    max_concurrent_trees: int = 64
    tree_failures_path: str | None = Field(None, description="JSONL the agent-loop workers append a failed tree "
                                           "to (stages/rl/verl/failures.py); None = not recorded")
    eos_token_ids: list[int] = Field(default_factory=list, description="tokenizer + generation config EOS ids "
                                     "of the policy (vLLM stops at all of them); empty = the tokenizer's")


def write_settings(settings: PluginSettings, path: str | Path) -> Path:
    write_json(Path(path), settings.model_dump(mode="json"))
    return Path(path)


@functools.lru_cache(maxsize=4)
def _read(path: str) -> PluginSettings:
    return PluginSettings.model_validate(json.loads(Path(path).read_text()))


def load_settings(path: str | None = None) -> PluginSettings:
    """The settings at `path`, else at $ARPO_VERL_SETTINGS; a missing file names the variable and the fix."""
    path = path or os.environ.get(SETTINGS_ENV)
    if not path:
        raise RuntimeError(f"${SETTINGS_ENV} is not set in this process; the RL stage's verl launcher sets it for "
                           "every Ray worker (ray_kwargs.ray_init.runtime_env.env_vars). Launch through "
                           "`arpo run` / stages.rl.verl.launch, not verl.trainer.main_ppo directly")
    if not Path(path).is_file():
        raise FileNotFoundError(f"${SETTINGS_ENV}={path} does not exist; the launcher writes it into the RL stage "
                                "folder, which every Ray node must see (shared filesystem)")
    return _read(str(path))
