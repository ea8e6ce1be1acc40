"""Flow parameters as a pydantic model, so the Prefect UI renders a form for them."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stages.core.plan import StageName


class PipelineParams(BaseModel):
    profile: str = Field("tiny-cpu", description="configs/profiles/<profile>.yaml")
    overrides: list[str] = Field(default_factory=list, description="key.sub=value, e.g. rl.rollout.n=8")
    only: list[StageName] = Field(default_factory=list, description="run just these stages (inputs from cache)")
    until: StageName | None = Field(None, description="run the chain up to and including this stage")
    refresh: list[StageName] = Field(default_factory=list, description="recompute these even if cached")
    refresh_from: StageName | None = Field(None, description="recompute this stage and everything after it")
