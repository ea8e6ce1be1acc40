from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.core.config.section import Section, used_when
from stages.core.input_files import input_file

PARQUET = used_when(source="parquet")
RL_PARQUET = {**PARQUET, **input_file("parquet", columns=("prompt", "reward_model"))}


class SyntheticSection(Section):
    """The self-made task set: math that needs python, multi-hop questions that need search."""

    seed: int = Field(0, description="seed of the generator: the same seed gives the same tasks and corpus, byte "
                      "for byte")
    n_math: int = Field(120, ge=0, description="math tasks that need python (big products, modular powers, digit "
                        "sums, prime counts), each with a reference python solution")
    n_qa: int = Field(120, ge=0, description="two-hop questions about fictional people, cities and companies, "
                      "answerable only by searching the generated corpus (at most 3 per person, n_entities x 3)")
    n_entities: int = Field(48, ge=4, description="fictional people in the generated corpus")
    n_arith: int = Field(0, ge=0, description="products of two arith_digits-digit numbers, one python call each "
                         "(the smallest family the tiny policy learns; bench/bench_learning.py)")
    arith_digits: int = Field(3, ge=1, le=9, description="digits of each factor of an arith task")
    n_chain: int = Field(0, ge=0, description="two dependent tool calls each: search the generated corpus for a "
                         "person / company / city, then python on the year it returns (years from it to "
                         "chain_year); needs n_chain <= n_entities * 5/3 (bench/bench_learning.py)")
    chain_year: int = Field(2025, description="the year chain questions count to")
    valid_fraction: float = Field(0.1, ge=0, lt=1, description="share of the (deduplicated) tasks in the valid "
                                  "split: the RL validation parquet (rl_valid)")
    test_fraction: float = Field(0.2, ge=0, lt=1, description="share of the tasks in the test split: the held-out "
                                 "evaluation set (eval_test, benchmark `synthetic`); the rest is train")


class DataSection(Section):
    """The data stage's input: generated tasks, or RL parquets in verl's schema (stages/data/)."""

    source: Literal["synthetic", "parquet"] = Field(
        "synthetic", description="synthetic = generate the task set and its corpus here (data.synthetic); parquet = "
        "read train_path / valid_path in the verl RL schema")
    synthetic: SyntheticSection = SyntheticSection()
    train_path: str | None = Field(None, description="verl RL parquet (source=parquet)",
                                   json_schema_extra=RL_PARQUET)
    valid_path: str | None = Field(None, description="verl RL parquet for validation (source=parquet)",
                                   json_schema_extra=RL_PARQUET)
    corpus_path: str | None = Field(None, description="FlashRAG JSONL corpus to ship with real data (source=parquet; "
                                    "the synthetic source generates its own)",
                                    json_schema_extra={**PARQUET, **input_file("jsonl")})
    system_prompt: str = Field("tir_search_python", description="template name under configs/templates/",
                               json_schema_extra=input_file("template"))
    fix_backspace_boxed: bool = Field(True, description="repair the 0x08 'oxed' quirk of the reference parquets",
                                      json_schema_extra=PARQUET)
    max_train_rows: int | None = Field(None, ge=1, description="use only the first N valid train rows (source="
                                       "parquet)", json_schema_extra=PARQUET)
    bad_rows: Literal["error", "skip"] = Field("skip", description="skip = log file+row of each bad row, go on "
                                               "(source=parquet)", json_schema_extra=PARQUET)

    @model_validator(mode="after")
    def _parquet_paths(self) -> DataSection:
        if self.source == "parquet" and not self.train_path:
            raise ValueError("data.source=parquet needs data.train_path (e.g. ../shared/data/rl/train_10k.parquet)")
        return self
