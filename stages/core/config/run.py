from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section


class RunSection(Section):
    """Where a run writes and how it uses the machine."""

    name: str = Field("tiny", description="label of the run; outputs go under <output_root>/runs/<name>-<time>")
    seed: int = 0
    output_root: str = Field("outputs", description="stage outputs (content-addressed) and run records")
    cache_root: str = Field(".cache", description="HF home, model wheels, search indexes, tool cache, Ray temp")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int | None = Field(None, description="torch intra-op threads; None = cores free at start")
    interpreters: dict[str, str] = Field(
        default_factory=dict,
        description="stage -> python executable to run that stage under (e.g. rl: /opt/vllm-env/bin/python); "
                    "stages not listed run in this process")

    def python_for(self, stage: str) -> str | None:
        return self.interpreters.get(stage)
