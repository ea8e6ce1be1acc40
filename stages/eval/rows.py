"""The rows evaluation writes and reads: one `PredictionRow` per (question, sample) in predictions.jsonl (the
predictions contract, docs/eval.md) and one `ScoredSample` per prediction in samples.jsonl.

The inference stage writes predictions; the scoring stage reads them back through `PredictionRow`, so a file
from elsewhere is checked field by field (a bad row names its file, its line and the field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

Text = Annotated[str, BeforeValidator(lambda v: v if isinstance(v, str) else str(v))]


class PredictionRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Text
    sample: int = Field(ge=0)
    question: str
    golds: list[Text] = Field(min_length=1, description="every accepted answer (a list even for one)")
    task_type: Literal["math", "qa"]
    prediction: str | None = Field(description="the extracted final answer (None: none found)")
    output: str = Field(description="everything the model and the tools wrote after the prompt")
    benchmark: str = ""
    finish_reason: str = ""
    tool_calls: dict[str, int] = Field(default_factory=dict)
    timing: dict[str, float] = Field(default_factory=dict, description="llm_s, python_s, search_s, total_s")
    timed_out: bool = False
    error: str | None = None
    model: str = ""
    benchmark_hash: str = ""
    completion_tokens: int = 0
    llm_calls: int = 0
    inference_tools: dict[str, int] = Field(
        default_factory=dict, description="Tool-Star's inference-time tools used: debug, rollback, refine")
    infra_failures: int = Field(0, ge=0, description="tool calls the environment failed (search provider, retrieval "
                                "server, sandbox): > 0 = not the model's answer; left out of the metrics and "
                                "retried by the next run")
    infra_errors: list[str] = Field(default_factory=list, description="what those failures said (first 3)")
    meta: dict[str, Any] = Field(default_factory=dict)


class ScoredSample(BaseModel):
    """Rule metrics, math_equal, the judge's verdict, and the headline `score` / binary `correct`."""

    model_config = ConfigDict(extra="forbid")

    id: str
    sample: int
    task_type: Literal["math", "qa"]
    golds: list[str]
    scored_text: str
    fallback_prediction: bool
    has_prediction: bool
    em: float
    f1: float
    acc: float
    math_equal: float = 0.0
    math_error: str | None = None
    rule_equiv: float = 0.0
    content_text: str = ""     # the answer wherever the output gives one (stages/eval/content.py)
    content_equal: float = 0.0  # content_text graded by the rule (math-verify for math, exact match for qa)
    python_calls: int
    search_calls: int
    inference_tools: dict[str, int] = Field(default_factory=dict)
    timed_out: bool
    error: str | None
    infra_failures: int = 0
    total_s: float
    benchmark: str
    model: str
    benchmark_hash: str
    judge_says_correct: bool | None = None
    judge_reply: str | None = None
    judge_cached: bool | None = None
    judge_error: str | None = None
    judge_model: str | None = None  # the judge response's `model` field (the id that answered)
    llm_equal: float | None = None
    score: float = 0.0
    correct: float = 0.0
