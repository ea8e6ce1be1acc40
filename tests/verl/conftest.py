"""Contract tests against verl 0.9.1 (no GPU, no vLLM). Collected only where verl is importable (.venv-verl-test);
the main suite runs them through tests/integration/test_verl_contract.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.core.config.agent import AgentSection
from stages.core.config.loader import load_config
from stages.core.config.rl import AdvantageSection, RolloutSection
from stages.rl.verl.mapping import VerlPaths, verl_overrides
from stages.rl.verl.settings import SETTINGS_ENV, PluginSettings, write_settings

pytestmark = pytest.mark.verl


def compose_verl(overrides: list[str]):
    """verl's real ppo_trainer.yaml composed with `overrides` (hydra's compose API; nothing is launched)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def paths(tmp: Path) -> VerlPaths:
    return VerlPaths(model=str(tmp / "model"), train_file=str(tmp / "train.parquet"), val_file=str(tmp / "v.parquet"),
                     checkpoints=str(tmp / "ckpt"), settings=str(tmp / "settings.json"),
                     agent_loops=str(tmp / "agent_loops.yaml"), rollout_dump=str(tmp / "rollouts"))


@pytest.fixture
def settings_file(tmp_path, monkeypatch):
    """Write plugin settings and point ARPO_VERL_SETTINGS at them (as the launcher does for every Ray worker)."""

    def make(advantage: AdvantageSection | None = None, algorithm: str = "arpo", agent: dict | None = None,
             **rollout) -> PluginSettings:
        """`agent`: the agent section (its tools, for a worker with the real ToolBox; cache under tmp_path)."""
        base = {"n": 4, "initial_rollouts": 2, "beam_size": 2, "branch_probability": 1.0,
                "entropy_weight": 0.0, "entropy_quantity": "surprisal", "call_limit": 1,
                "max_prompt_length": 256, "max_response_length": 160}
        settings = PluginSettings(algorithm=algorithm, rollout=RolloutSection(**{**base, **rollout}),
                                  advantage=advantage or AdvantageSection(), seed=5, eos_token_ids=[0],
                                  agent=AgentSection.model_validate(agent or {}), cache_root=str(tmp_path / "cache"))
        path = write_settings(settings, tmp_path / f"settings-{len(list(tmp_path.iterdir()))}.json")
        monkeypatch.setenv(SETTINGS_ENV, str(path))
        return settings

    return make


@pytest.fixture(scope="session")
def tiny_verl_config(tmp_path_factory):
    cfg = load_config("tiny-cpu", ["rl.engine=verl", "rl.rollout.n=4", "rl.rollout.initial_rollouts=2"])
    return compose_verl(verl_overrides(cfg.rl, "float32", 0, paths(tmp_path_factory.mktemp("verl"))))
