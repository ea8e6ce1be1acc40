from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section
from stages.core.config.serve import ServeSection


class JudgeSection(Section):
    """LLM-as-judge. `policy` reuses the served policy model; otherwise the judge is served per `serve`."""

    enabled: bool = True
    model: Literal["policy", "path"] = "policy"
    path: str | None = Field(None, description="judge model folder or hub id (model=path)")
    serve: ServeSection = ServeSection()
    max_retries: int = 3
    concurrency: int = 4


class EvalSection(Section):
    enabled: bool = True
    benchmarks: list[str] = Field(default_factory=lambda: ["synthetic"])
    data_root: str = Field("../shared/data/eval", description="folder with <benchmark>/test.jsonl files")
    max_questions: int | None = Field(None, ge=1, description="cap per benchmark; None = benchmark default")
    samples: int = Field(1, ge=1, description="samples per question (k for pass@k)")
    pass_k: list[int] = Field(default_factory=lambda: [1])
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = Field(4096, description="tokens per generation call")
    max_total_tokens: int = Field(8192, description="response budget per sample across calls")
    concurrency: int = Field(8, ge=1)
    sample_timeout_s: float = 1500.0
    max_python: int = 5
    max_search: int = 10
    judge: JudgeSection = JudgeSection()
