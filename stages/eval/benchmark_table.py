"""The benchmark tables of docs/eval.md, made from the registries of stages/eval/benchmarks.py (never typed): one row
per `BenchmarkSpec` and one per gold-answer parser, between `<!-- benchmark-table:start -->` and
`<!-- benchmark-table:end -->`.

Rewritten and checked with every other generated block: `python -m flows.cli docs --write` (flows/generated_docs.py);
tests/unit/test_config_doc.py fails when the page differs from the registry.
"""

from __future__ import annotations

import inspect

from stages.core.doc_block import DOCS_COMMAND, replace_block
from stages.core.env import PROJECT_ROOT
from stages.eval.benchmarks import BENCHMARKS, GOLD_PARSERS, BenchmarkSpec

DOC = PROJECT_ROOT / "docs" / "eval.md"
START, END = "<!-- benchmark-table:start -->", "<!-- benchmark-table:end -->"
NONE = "—"


def _code(values: tuple[str, ...] | list[str], joiner: str = ", else ") -> str:
    return joiner.join(f"`{v}`" for v in values)


def _fields(spec: BenchmarkSpec) -> str:
    parts = [f"question `{spec.question_field}`", f"answer `{spec.answer_field}`"]
    parts += [f"id `{spec.id_field}`"] if spec.id_field else []
    parts += [f"meta {_code(spec.meta_fields, ', ')}"] if spec.meta_fields else []
    return ", ".join(parts)


def _notes(spec: BenchmarkSpec) -> str:
    parts = [f"rows with `{key}` = {value} left out" for key, value in spec.skip_if]
    parts += [f"its own prompt `{spec.prompt_template}`"] if spec.prompt_template else []
    parts += [f"browses with the `{spec.browse_language}` variant"] if spec.browse_language else []
    return "; ".join(parts) or NONE


def _hub(spec: BenchmarkSpec) -> str:
    if spec.hub is None:
        return NONE
    return f"{spec.hub.dataset}" + (f" ({spec.hub.config})" if spec.hub.config else "") + f", {spec.hub.split}"


def benchmark_table() -> str:
    rows = ["| name | group | type | file under `eval.data_root` | fields | gold parser | headline | default cap | "
            "language | reference's search | hub fallback | notes |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, spec in BENCHMARKS.items():
        files = _code(spec.files) if spec.files else "none: the caller passes the file (the data stage's `eval_test`)"
        task_type = "per-row `kind`" if spec.task_type == "mixed" else spec.task_type
        rows.append(f"| {name} | {spec.group} | {task_type} | {files} | {_fields(spec)} | [{spec.gold}](#gold-parsers)"
                    f" | {spec.headline} | {spec.default_cap} | {spec.language} | {spec.search_backend} | "
                    f"{_hub(spec)} | {_notes(spec)} |")
    return "\n".join(rows)


def parser_table() -> str:
    rows = ["| gold parser | what it does |", "|---|---|"]
    for name, parser in GOLD_PARSERS.items():
        doc = " ".join(inspect.cleandoc(parser.__doc__ or "").split())
        rows.append(f"| {name} | {doc.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def tables() -> str:
    return (f"<!-- generated from stages/eval/benchmarks.py by `{DOCS_COMMAND}` -->\n\n{benchmark_table()}\n\n"
            f"#### Gold parsers\n\n{parser_table()}")


def render(text: str) -> str:
    """docs/eval.md's `text` with the generated block replaced by the tables from the registries."""
    return replace_block(text, START, END, tables(), str(DOC))
