"""The whole run's configuration: one frozen model, one section per stage."""

from __future__ import annotations

from stages.core.config.agent import AgentSection
from stages.core.config.data import DataSection
from stages.core.config.eval import EvalSection
from stages.core.config.model import ModelSection
from stages.core.config.rl import MergeSection, RLSection
from stages.core.config.run import RunSection
from stages.core.config.section import Section
from stages.core.config.serve import ServeSection
from stages.core.config.sft import SFTSection
from stages.core.fingerprint import hash_value


class RunConfig(Section):
    profile: str = "tiny-cpu"
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    agent: AgentSection = AgentSection()
    sft: SFTSection = SFTSection()
    rl: RLSection = RLSection()
    merge: MergeSection = MergeSection()
    serve: ServeSection = ServeSection()
    eval: EvalSection = EvalSection()

    def section_hash(self, name: str) -> str:
        return hash_value(getattr(self, name))
