"""Small frozen references handed from stage to stage: paths plus content fingerprints, never tensors.

A ref's fingerprint is what downstream cache keys hash, so it changes whenever the stage rebuilt its output
(it includes the build id written at completion), and stays put when the stage was served from cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(description="file or folder this ref points at")
    fingerprint: str = Field(description="content hash + build id of what is at `path`")
    meta: dict[str, Any] = Field(default_factory=dict)

    def exists(self) -> bool:
        return Path(self.path).exists()


class ModelRef(Ref):
    """A Hugging Face model folder (config.json + weights + tokenizer)."""

    kind: Literal["model"] = "model"
    name: str = ""
    template: str = Field("", description="LLaMA-Factory chat template name for this model family")


class DatasetRef(Ref):
    """A folder of data files; `files` maps a role (rl_train, eval_test, corpus, ...) to a path."""

    kind: Literal["dataset"] = "dataset"
    files: dict[str, str] = Field(default_factory=dict)

    def file(self, role: str) -> Path:
        if role not in self.files:
            raise KeyError(f"dataset {self.path} has no {role!r} file; it has {sorted(self.files)}")
        return Path(self.files[role])


class CheckpointRef(Ref):
    """Trained weights: an HF folder, a LoRA adapter over `base`, a trainer checkpoint folder, or a verl FSDP
    actor folder (`global_step_<N>/actor`, merged by stages.rl.fsdp_merge)."""

    kind: Literal["checkpoint"] = "checkpoint"
    format: Literal["hf", "lora", "trainer", "verl_fsdp"] = "hf"
    base: ModelRef | None = None
    step: int | None = None


class EndpointRef(BaseModel):
    """An OpenAI-compatible server; not fingerprinted by content (it is a live process)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["endpoint"] = "endpoint"
    url: str
    model: str
    api_key_env: str | None = None
    model_fingerprint: str = ""
    meta: dict[str, Any] = Field(default_factory=dict)

    @property
    def identity(self) -> str:
        """What the endpoint *is* (served name + weights fingerprint), never where it runs (URL/port): what a
        cache key hashes."""
        return f"{self.model}@{self.model_fingerprint}" if self.model_fingerprint else self.model


class PredictionsRef(Ref):
    kind: Literal["predictions"] = "predictions"
    benchmark: str = ""


class ScoresRef(Ref):
    kind: Literal["scores"] = "scores"
    benchmark: str = ""
