from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.core.config.section import Section


class SyntheticSection(Section):
    """The self-made task set: math that needs python, multi-hop questions that need search."""

    seed: int = 0
    n_math: int = Field(120, ge=0)
    n_qa: int = Field(120, ge=0)
    n_entities: int = Field(48, ge=4, description="fictional people in the generated corpus")
    n_arith: int = Field(0, ge=0, description="products of two arith_digits-digit numbers, one python call each "
                         "(the smallest family the tiny policy learns; bench/bench_learning.py)")
    arith_digits: int = Field(3, ge=1, le=9, description="digits of each factor of an arith task")
    valid_fraction: float = Field(0.1, ge=0, lt=1)
    test_fraction: float = Field(0.2, ge=0, lt=1)


class DataSection(Section):
    source: Literal["synthetic", "parquet"] = "synthetic"
    synthetic: SyntheticSection = SyntheticSection()
    train_path: str | None = Field(None, description="verl RL parquet (source=parquet)")
    valid_path: str | None = Field(None, description="verl RL parquet for validation (source=parquet)")
    corpus_path: str | None = Field(None, description="FlashRAG JSONL corpus to ship with real data")
    system_prompt: str = Field("tir_search_python", description="template name under configs/templates/")
    fix_backspace_boxed: bool = Field(True, description="repair the 0x08 'oxed' quirk of the reference parquets")
    max_train_rows: int | None = Field(None, ge=1)
    bad_rows: Literal["error", "skip"] = Field("skip", description="skip = log file+row of each bad row, go on")

    @model_validator(mode="after")
    def _parquet_paths(self) -> DataSection:
        if self.source == "parquet" and not self.train_path:
            raise ValueError("data.source=parquet needs data.train_path (e.g. ../shared/data/rl/train_10k.parquet)")
        return self
