"""The whole run's configuration: one frozen model, one section per stage."""

from __future__ import annotations

from pydantic import Field, ValidationError, model_validator

from stages.core.config.agent import AgentSection, SearchSection
from stages.core.config.cost import CostSection
from stages.core.config.data import DataSection
from stages.core.config.eval import EvalSection
from stages.core.config.merge import MergeSection
from stages.core.config.model import ModelSection
from stages.core.config.rl import RLSection
from stages.core.config.rl_engine import local_engine_problem, params_from_name
from stages.core.config.run import RunSection
from stages.core.config.section import Section
from stages.core.config.serve import ServeSection
from stages.core.config.sft import SFTSection
from stages.core.config.tracking import TrackingSection
from stages.core.engine_spec import ENGINES


class RunConfig(Section):
    """Every setting of a run: the models' defaults, a profile's differences and -o overrides on top."""

    profile: str = Field("tiny-cpu", description="the profile's name, set by the loader from its file "
                         "(configs/profiles/<name>.yaml); it labels the run record, the tracker's experiment and "
                         "tags, and a rehearsal")
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    agent: AgentSection = AgentSection()
    sft: SFTSection = SFTSection()
    rl: RLSection = RLSection()
    merge: MergeSection = MergeSection()
    serve: ServeSection = ServeSection()
    eval: EvalSection = EvalSection()
    cost: CostSection = CostSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _local_engine_fits(self) -> RunConfig:
        """Refuse, before any work, a policy the one-device local RL engine cannot hold (sized from its name)."""
        params = None if self.model.source == "toy" else params_from_name(self.model.name, self.model.path)
        one_device = self.rl.engine in ENGINES and not ENGINES.get(self.rl.engine).cluster  # engine_spec.py
        if self.rl.enabled and one_device and params is not None:
            problem = local_engine_problem(params, self.rl.local_memory_gb, self.rl.rollout.backend,
                                           self.rl.loss.kl_coef > 0)
            if problem:
                raise ValueError(f"rl.engine={self.rl.engine} with model {self.model.name!r}: {problem}")
        return self

    @model_validator(mode="after")
    def _dpo_fallback_has_its_input(self) -> RunConfig:
        """The teacher fallback of self-critic DPO replays the generated tasks' solutions: there are none for a
        parquet (stages/sft/dpo.py)."""
        dpo = self.sft.dpo
        if dpo.enabled and dpo.source == "sampled" and dpo.chosen_fallback == "teacher" and self.data.source != "synthetic":
            raise ValueError("sft.dpo.chosen_fallback=teacher needs the generated task set (data.source=synthetic): "
                             f"data.source={self.data.source} has no teacher trajectories; set "
                             "sft.dpo.chosen_fallback=gold (a minimal answer with the ground truth) or none")
        return self

    @model_validator(mode="after")
    def _verl_cpu_mode_on_cpu_only(self) -> RunConfig:
        """verl's CPU mode (stages/rl/verl/cpu_mode.py) replaces CUDA calls with host ones: never on a GPU run."""
        if self.rl.verl.cpu_mode and self.run.device != "cpu":
            raise ValueError(f"rl.verl.cpu_mode is verl on a CPU box (a rehearsal or the suite's verl run), but "
                             f"run.device={self.run.device}: set run.device=cpu, or rl.verl.cpu_mode=false for a GPU "
                             "run")
        return self

    @model_validator(mode="after")
    def _browsing_settings(self) -> RunConfig:
        """The summariser needs something that browses; the benchmarks of eval.browse browse with agent.search's
        settings, so those settings must hold with browsing on (e.g. mode=replay needs its replay_path)."""
        search = self.agent.search
        browses = self.eval.enabled and bool(self.eval.browse)
        if search.summarizer.model and not search.browse.enabled and not browses:
            raise ValueError("agent.search.summarizer.model is set but nothing browses (agent.search.browse.enabled "
                             "is false and eval.browse is empty): the summariser reads browsed pages; enable "
                             "browsing, name benchmarks in eval.browse, or unset the summariser")
        if search.browse.enabled and search.summarizer.served_here:
            # every stage that runs the agent browses then (SFT teacher, RL rollouts, held-out), and only the
            # evaluation starts a summariser from `path`
            raise ValueError(f"agent.search.browse.enabled browses in every stage that runs the agent (SFT teacher, "
                             f"RL rollouts, held-out), but agent.search.summarizer.path={search.summarizer.path!r} "
                             "is served by the evaluation only: give agent.search.summarizer.url (a server you run) "
                             "instead, or browse in evaluation only (agent.search.browse.enabled=false, "
                             "eval.browse=[<benchmarks>])")
        if browses and not search.browse.enabled:
            try:
                SearchSection.model_validate(search.model_dump() | {"browse": search.browse.model_dump()
                                                                    | {"enabled": True}})
            except ValidationError as err:
                raise ValueError(f"eval.browse={self.eval.browse} browses with agent.search's settings: "
                                 f"{err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self
