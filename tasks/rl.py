"""The RL task: a cached stage call. RL publishes its progress, curves, rollout sample and alarms while it
runs (stages.core.reporter -> tasks/live.py); the task publishes the run's algorithm card (`rl-algorithm-card`,
stages/rl/card.py) before calling the stage, which is why it is written by hand (merge, with no card, is
tasks.stage_tasks.entry_task's).

`python` runs the stage under another interpreter (config `run.interpreters`, filled in by the flow's
tasks.stage_tasks.StageRunner); the entry point is the stage table's (`call_entry`); the key function asks that
interpreter what it needs of it (verl's version), and the RL settings that only watch the run (alarms, artifact
refresh) are not part of the key (stages.rl.identity.training_identity, used by stages.rl.stage.rl_key).
"""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.artifacts import publish_table
from tasks.secrets import export_search_key
from tasks.stage_tasks import call_entry, stage_task


@stage_task("rl")
def rl_task(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
            output_root: str, cache_root: str, seed: int = 0, dtype: str = "float32",
            python: str | None = None) -> CheckpointRef:
    export_search_key(agent)
    publish_card(cfg)
    return call_entry(python, cfg=cfg, agent=agent, policy=policy, data=data, output_root=output_root,
                      cache_root=cache_root, seed=seed, dtype=dtype)


def publish_card(cfg: RLSection) -> None:
    """The run's algorithm card as the `rl-algorithm-card` table (stages/rl/card.py)."""
    from stages.rl.card import algorithm_card, card_table

    card = algorithm_card(cfg)
    publish_table("rl-algorithm-card", card_table(card), f"{cfg.algorithm} on the {cfg.engine} engine vs the "
                  f"published run {card.reference.name}: each mechanism, same or differs and why (docs/reference.md)")
