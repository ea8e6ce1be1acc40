"""The `heldout` stage task: one policy (base, SFT or RL) on the held-out split, cached on the stage's own key, so
each policy is evaluated once however often the report is rebuilt."""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.eval import HeldoutSection
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef, ScoresRef
from tasks.common import call_entry, stage_task
from tasks.secrets import export_search_key


@stage_task("heldout")
def _heldout(spec: HeldoutSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
             output_root: str, cache_root: str, label: str = "policy") -> ScoresRef:
    export_search_key(agent)
    return call_entry(spec=spec, agent=agent, policy=policy, data=data, output_root=output_root,
                      cache_root=cache_root)


heldout_task = _heldout.with_options(task_run_name="heldout-{label}")
