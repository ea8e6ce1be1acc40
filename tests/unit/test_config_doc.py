"""The generated docs pages: every config field has a description, docs/config.md is what the models make now, and
docs/eval.md's benchmark tables are what the registry holds (stages.core.config.config_doc,
stages.eval.benchmark_table)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config import config_doc
from stages.core.config.section import Section, registry, used_when
from stages.core.doc_block import DOCS_COMMAND
from stages.core.input_files import input_file
from stages.eval import benchmark_table


class _Sub(Section):
    """A subsection."""

    depth: int = Field(2, ge=1, le=8, description="how deep")


class _Toy(Section):
    mode: Literal["a", "b"] = Field("a", description="the mode")
    path: str | None = Field(None, description="a file", json_schema_extra={**used_when(mode="b"),
                                                                               **input_file("jsonl")})
    backend: str = Field("vllm", description="serving", json_schema_extra=registry("serving backend"))
    bare: float = 0.5
    sub: _Sub = _Sub()


def test_every_config_field_has_a_description() -> None:
    missing = config_doc.undocumented()
    assert not missing, f"fields without a description (give their Field(...) one): {missing}"


def test_an_undocumented_field_is_found() -> None:
    assert config_doc.undocumented(_Toy) == ["bare"]  # sub.depth is described; a section is walked, not listed


def test_a_row_shows_type_default_bounds_and_when() -> None:
    rows = {row[0]: row for row in config_doc.rows(_Toy, "toy.")}
    # hand-derived: a Literal is a str with its choices; the input file and the mode both show; a registry's names
    assert rows["`toy.mode`"][1:4] == ["str", "`a`", "one of a, b"]
    assert rows["`toy.path`"][1:3] == ["str \\| None", "`null`"]
    assert rows["`toy.path`"][5] == "when mode = b; input file: jsonl (checked before any work)"
    assert rows["`toy.backend`"][3] == "serving backend registry: vllm, external"
    assert "`toy.sub`" not in rows  # a nested section gets a table of its own
    assert config_doc.rows(_Sub, "toy.sub.")[0][3] == ">= 1; <= 8"


def test_a_section_shared_by_several_keys_is_shown_once() -> None:
    tables = {t.key: t for t in config_doc.tables()}
    assert tables["serve"].rows and tables["serve"].same_as is None
    assert tables["eval.judge.serve"].same_as == "serve" and not tables["eval.judge.serve"].rows
    assert "eval.judge.serve.vllm" not in tables  # shown under serve.vllm
    assert len(tables["rl.optim"].rows) == len(tables["rl.optim"].model.model_fields)


def test_docs_eval_md_benchmark_tables_are_up_to_date() -> None:
    text = benchmark_table.DOC.read_text(encoding="utf-8")
    assert text == benchmark_table.render(text), f"docs/eval.md's benchmark table is stale: run " \
                                                 f"`{DOCS_COMMAND}`"
    for name in benchmark_table.BENCHMARKS:
        assert f"\n| {name} |" in text
