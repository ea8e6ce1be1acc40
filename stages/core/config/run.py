from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from stages.core.config.section import Section
from stages.core.stage_spec import ISOLATABLE  # stages that may run under another interpreter (the stage table)


class RunSection(Section):
    """Where a run writes and how it uses the machine."""

    name: str = Field("run", description="label of the run; outputs go under <output_root>/runs/<name>-<time>")
    seed: int = Field(0, description="seed of the RL stage: Python's and torch's generators and every step's rollout "
                      "seed (a function of it and the step, so a resumed run repeats them); the data, SFT and "
                      "evaluation have their own (data.synthetic.seed, sft.seed, eval.bootstrap_seed)")
    output_root: str = Field("outputs", description="stage outputs (content-addressed) and run records")
    cache_root: str = Field(".cache", description="HF home, model wheels, search indexes, tool cache, Ray temp")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="the machine the run is meant for: cpu allows rl.verl.cpu_mode (refused otherwise) and is "
        "what `arpo rehearse` sets; the stages themselves train and sample on CUDA whenever it is available")
    torch_threads: int | None = Field(None, description="torch intra-op threads; None = cores free at start")
    interpreters: dict[str, str] = Field(
        default_factory=dict,
        description="stage -> python executable to run that stage under (e.g. rl: /opt/vllm-env/bin/python); "
                    "stages not listed run in this process")

    @field_validator("interpreters")
    @classmethod
    def _known_stages(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(ISOLATABLE))
        if unknown:
            raise ValueError(f"run.interpreters names {unknown}; stages that can run under another interpreter are "
                             f"{list(ISOLATABLE)} (serving uses serve.vllm.executable)")
        return value

    def python_for(self, stage: str) -> str | None:
        return self.interpreters.get(stage)
