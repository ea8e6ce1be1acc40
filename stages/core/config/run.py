from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from stages.core.config.section import Section
from stages.core.stage_spec import ISOLATABLE  # stages that may run under another interpreter (the stage table)


class RunSection(Section):
    """Where a run writes and how it uses the machine."""

    name: str = Field("run", description="label of the run; outputs go under <output_root>/runs/<name>-<time>")
    seed: int = 0
    output_root: str = Field("outputs", description="stage outputs (content-addressed) and run records")
    cache_root: str = Field(".cache", description="HF home, model wheels, search indexes, tool cache, Ray temp")
    device: Literal["auto", "cpu", "cuda"] = "auto"
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
