"""Benchmark registry and loaders: one `BenchmarkSpec` per benchmark, one `load_benchmark` for all of them.

A spec says where the file lives under `eval.data_root` (the reference layout `<dir>/test.jsonl`), which field
holds the question and the answer, how the gold answer is parsed (a gold parser registered by name), the task type
(math | qa; `mixed` = per-row `kind`, our generated set), the default cap (math 500, QA 200, HLE 500 as in the
Tool-Star README, SimpleQA 500 as ARPO's `COUNTS=500`; smaller files are read whole), the headline metric the
papers report for it, its own system prompt where the reference used one (xbench: Chinese), the search backend the
reference used and, when it browses, the variant of the browsing tool the reference used for it (xbench: the
Chinese one, `browse.language: zh`). A hub dataset id is the documented fallback when the local file is absent;
offline it fails with a message naming every file tried and the hub id.

Every loaded benchmark carries a content hash over exactly the items that were loaded (after the cap), so
each result row can name the data it was computed on.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.core.atomic import read_jsonl
from stages.core.errors import BadInputError, MissingInputError
from stages.core.fingerprint import hash_value
from stages.core.log import get_logger
from stages.core.registry import Registry

log = get_logger(__name__)

TASK_TYPES = ("math", "qa")
# The per-sample metric the papers report per benchmark (ARPO issue #60; docs/reference.md "Evaluation"): F1 for the
# knowledge-QA sets of Table 1, the judge's llm_equal for math, WebWalker and the deep-search sets (Table 2).
HEADLINES = ("llm_equal", "f1")

GOLD_PARSERS: Registry[Callable[[Any], tuple[str, ...]]] = Registry("gold-answer parser")


@dataclass(frozen=True)
class EvalItem:
    id: str
    question: str
    golds: tuple[str, ...]
    task_type: str  # math | qa
    meta: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class HubSource:
    """Where the same benchmark lives on the Hugging Face hub, and its field names there."""

    dataset: str
    split: str
    question_field: str
    answer_field: str
    config: str | None = None
    id_field: str | None = None


@dataclass(frozen=True, kw_only=True)
class BenchmarkSpec:
    name: str
    task_type: str  # math | qa | mixed (per-row `kind` field)
    group: str  # math | knowledge | deepsearch | generated: how the paper groups it
    files: tuple[str, ...]  # candidate paths relative to eval.data_root, first existing wins
    question_field: str
    default_cap: int
    answer_field: str = "answer"
    id_field: str | None = None
    gold: str = "list"  # GOLD_PARSERS name
    headline: str = "llm_equal"  # HEADLINES: the metric the papers report (f1 for the knowledge-QA sets)
    prompt_template: str | None = None  # the reference's own system prompt for it (xbench: Chinese), else the run's
    search_backend: str = "web"  # agent.search.backend the reference used for it
    browse_language: str | None = None  # the reference's browsing-tool variant for it (xbench: zh), else the run's
    meta_fields: tuple[str, ...] = ()
    language: str = "en"
    hub: HubSource | None = None
    skip_if: tuple[tuple[str, Any], ...] = ()  # (field, value): rows to leave out (e.g. HLE image rows)


# --------------------------------------------------------------------------------------------- gold parsers
@GOLD_PARSERS.register("plain")
def gold_plain(value: Any) -> tuple[str, ...]:
    """One answer kept verbatim (LaTeX, intervals like "[1, 2)", free text): no list parsing."""
    text = str(value).strip()
    return (text,) if text else ()


@GOLD_PARSERS.register("list")
def gold_list(value: Any) -> tuple[str, ...]:
    """Aliases: a JSON list, a string holding a Python list ("['Frank Lowy']"), or one plain string."""
    from stages.agent.answer_match import parse_gold

    if isinstance(value, (list, tuple)):
        golds = [str(v).strip() for v in value]
    else:
        golds = [str(v).strip() for v in parse_gold(str(value))]
    return tuple(dict.fromkeys(g for g in golds if g))


_GSM8K_NUMBER = re.compile(r"####\s*(.+?)\s*$", re.S)


@GOLD_PARSERS.register("gsm8k")
def gold_gsm8k(value: Any) -> tuple[str, ...]:
    """GSM8K solution text: the number after `####`, thousands separators removed ("1,000" -> "1000")."""
    match = _GSM8K_NUMBER.search(str(value))
    if not match:
        raise ValueError(f"gsm8k answer has no '#### <number>' line: {str(value)[-80:]!r}")
    return (match.group(1).replace(",", "").strip(),)


# --------------------------------------------------------------------------------------------- the table
def _flashrag(config: str) -> HubSource:
    return HubSource(dataset="RUC-NLPIR/FlashRAG_datasets", split="dev" if config != "bamboogle" else "test",
                     question_field="question", answer_field="golden_answers", config=config, id_field="id")


_SPECS = [
    BenchmarkSpec(name="aime24", task_type="math", group="math", files=("aime24/test.jsonl",),
                  question_field="question", default_cap=500, id_field="id", gold="plain", meta_fields=("url",),
                  hub=HubSource(dataset="HuggingFaceH4/aime_2024", split="train", question_field="problem",
                                answer_field="answer", id_field="id")),
    BenchmarkSpec(name="aime25", task_type="math", group="math", files=("aime25/test.jsonl",), question_field="problem",
                  default_cap=500, id_field="id", gold="plain",
                  hub=HubSource(dataset="math-ai/aime25", split="test", question_field="problem", answer_field="answer",
                                id_field="id")),
    BenchmarkSpec(name="math500", task_type="math", group="math", files=("math500/test.jsonl",),
                  question_field="question", default_cap=500, gold="plain",
                  hub=HubSource(dataset="HuggingFaceH4/MATH-500", split="test", question_field="problem",
                                answer_field="answer", id_field="unique_id")),
    BenchmarkSpec(name="gsm8k", task_type="math", group="math", files=("gsm8k/test.jsonl",), question_field="question",
                  default_cap=500, id_field="idx", gold="gsm8k",
                  hub=HubSource(dataset="openai/gsm8k", split="test", question_field="question", answer_field="answer",
                                config="main")),
    BenchmarkSpec(name="math", task_type="math", group="math", files=("math/test.jsonl",), question_field="problem",
                  default_cap=500, gold="plain", meta_fields=("level", "type", "subject")),
    BenchmarkSpec(name="hotpotqa", task_type="qa", group="knowledge", files=("hotpotqa/test.jsonl",),
                  question_field="question", default_cap=200, headline="f1", search_backend="server",
                  hub=_flashrag("hotpotqa")),
    BenchmarkSpec(name="2wiki", task_type="qa", group="knowledge", files=("2wiki/test.jsonl",),
                  question_field="question", default_cap=200, headline="f1", search_backend="server",
                  hub=_flashrag("2wikimultihopqa")),
    BenchmarkSpec(name="musique", task_type="qa", group="knowledge", files=("musique/test.jsonl",),
                  question_field="question", default_cap=200, headline="f1", search_backend="server",
                  hub=_flashrag("musique")),
    BenchmarkSpec(name="bamboogle", task_type="qa", group="knowledge", files=("bamboogle/test.jsonl",),
                  question_field="question", default_cap=200, headline="f1", search_backend="server",
                  hub=_flashrag("bamboogle")),
    BenchmarkSpec(name="webwalker", task_type="qa", group="knowledge", files=("webwalker/test.jsonl",),
                  question_field="question", default_cap=200, gold="plain", language="zh+en"),
    BenchmarkSpec(name="gaia", task_type="qa", group="deepsearch", files=("gaia/test.jsonl",),
                  question_field="Question", default_cap=200, id_field="task_id", gold="plain", meta_fields=("Level",),
                  hub=HubSource(dataset="gaia-benchmark/GAIA", split="validation", question_field="Question",
                                answer_field="Final answer", config="2023_all", id_field="task_id")),
    BenchmarkSpec(name="hle", task_type="qa", group="deepsearch", files=("hle/test.jsonl", "hle/top.json"),
                  question_field="question", default_cap=500, id_field="id", gold="plain",
                  meta_fields=("answer_type", "category", "raw_subject"), skip_if=(("has_image", True),),
                  hub=HubSource(dataset="cais/hle", split="test", question_field="question", answer_field="answer",
                                id_field="id")),
    BenchmarkSpec(name="simpleqa", task_type="qa", group="deepsearch",
                  files=("SimpleQA/test.jsonl", "simpleqa/test.jsonl"), question_field="question", default_cap=500,
                  hub=HubSource(dataset="basicv8vc/SimpleQA", split="test", question_field="problem",
                                answer_field="answer")),
    BenchmarkSpec(name="xbench", task_type="qa", group="deepsearch", files=("xbench/test.jsonl",),
                  question_field="question", default_cap=200, language="zh", prompt_template="tir_search_python_zh",
                  browse_language="zh"),
    BenchmarkSpec(name="synthetic", task_type="mixed", group="generated", files=(), question_field="question",
                  default_cap=200, id_field="id", gold="plain", search_backend="local", meta_fields=("kind",)),
]
BENCHMARKS: Registry[BenchmarkSpec] = Registry("benchmark", {spec.name: spec for spec in _SPECS})


@dataclass(frozen=True)
class LoadedBenchmark:
    spec: BenchmarkSpec
    items: list[EvalItem]
    content_hash: str
    source: str = ""  # the file (or hub id) the rows came from
    skipped: int = 0  # rows left out by `spec.skip_if`


def get_spec(name: str) -> BenchmarkSpec:
    return BENCHMARKS.get(name)


def headline_metric(name: str) -> str:
    """The metric the papers report for benchmark `name` (llm_equal for names we do not know)."""
    return BENCHMARKS[name].headline if name in BENCHMARKS else "llm_equal"


def prompt_template_for(spec: BenchmarkSpec, run_template: str, use_own: bool = True) -> str:
    """The system prompt a benchmark runs with: its own where the reference used one (xbench goes through the
    reference's Chinese inference script with the Chinese `code_search_cn` prompt) when it offers the same tools
    as the run's `agent.prompt_template`, else the run's."""
    from stages.agent.prompt_templates import template_tools

    own = spec.prompt_template
    if not use_own or own is None or own == run_template:
        return run_template
    if template_tools(own) != template_tools(run_template):
        log.warning("%s: its own prompt %r offers tools %s, the run's %r offers %s; using the run's", spec.name,
                    own, template_tools(own), run_template, template_tools(run_template))
        return run_template
    return own


def check_benchmarks(names: list[str], data_root: str | Path, cap: int | None = None) -> None:
    """Fail before any work when a benchmark is unknown, its file is missing (and no hub copy can stand in), naming
    every file tried, or a row it would use is malformed (naming file and line). `synthetic` comes from the data
    stage and is not checked here."""
    missing = []
    for name in names:
        spec = get_spec(name)
        if spec.name == "synthetic":
            continue
        if _existing_file(spec, Path(data_root)) is not None:
            load_benchmark(name, data_root, cap)  # every row the run would use, as inference reads it
            continue
        if spec.hub is not None and not _offline():
            continue
        missing.append(_missing_message(spec, Path(data_root)))
    if missing:
        raise MissingInputError("\n".join(missing))


def load_benchmark(name: str, data_root: str | Path, cap: int | None = None,
                   synthetic_path: str | Path | None = None) -> LoadedBenchmark:
    """Load, map and cap one benchmark. `cap=None` applies the spec's default cap; the first rows are kept."""
    spec = get_spec(name)
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 (got {cap}); use None for the benchmark default ({spec.default_cap})")
    rows, source = _read_rows(spec, Path(data_root), synthetic_path)
    items: list[EvalItem] = []
    skipped = 0
    limit = cap if cap is not None else spec.default_cap
    for index, row in enumerate(rows):
        if any(row.get(key) == value for key, value in spec.skip_if):
            skipped += 1
            continue
        if len(items) >= limit:
            break
        items.append(_to_item(spec, row, index, source))
    if skipped:
        log.info("%s: left out %d rows matching %s", name, skipped, spec.skip_if)
    content_hash = hash_value(name, [[i.id, i.question, list(i.golds), i.task_type] for i in items])
    return LoadedBenchmark(spec=spec, items=items, content_hash=content_hash, source=source, skipped=skipped)


def _to_item(spec: BenchmarkSpec, row: dict[str, Any], index: int, source: str) -> EvalItem:
    where = f"{source} row {index + 1}"
    question = row.get(spec.question_field)
    if not isinstance(question, str) or not question.strip():
        raise BadInputError(f"{where}: field {spec.question_field!r} (the {spec.name} question) is missing or empty; "
                         f"row has fields {sorted(row)}")
    if spec.answer_field not in row or row[spec.answer_field] is None:
        raise BadInputError(f"{where}: field {spec.answer_field!r} (the gold answer) is missing; row has {sorted(row)}")
    try:
        golds = GOLD_PARSERS.get(spec.gold)(row[spec.answer_field])
    except ValueError as err:
        raise BadInputError(f"{where}: {err}") from err
    if not golds:
        raise BadInputError(f"{where}: gold answer {row[spec.answer_field]!r} is empty after parsing; fix the row")
    task_type = spec.task_type
    if task_type == "mixed":
        task_type = str(row.get("kind", ""))
        if task_type not in TASK_TYPES:
            raise BadInputError(f"{where}: field 'kind' must be one of {TASK_TYPES}, got {row.get('kind')!r}")
    raw_id = row.get(spec.id_field) if spec.id_field else None
    item_id = str(raw_id) if raw_id not in (None, "") else f"{spec.name}-{index}"
    meta = {key: row[key] for key in spec.meta_fields if key in row}
    return EvalItem(id=item_id, question=question.strip(), golds=golds, task_type=task_type, meta=meta)


# --------------------------------------------------------------------------------------------- reading
def _read_rows(spec: BenchmarkSpec, data_root: Path, synthetic_path: str | Path | None
               ) -> tuple[list[dict[str, Any]], str]:
    if spec.name == "synthetic":
        if synthetic_path is None:
            raise MissingInputError("benchmark 'synthetic' is the data stage's generated set: pass its file, "
                                    "load_benchmark('synthetic', data_root, synthetic_path=dataset.file('eval_test'))")
        return _read_json_lines(Path(synthetic_path)), str(synthetic_path)
    path = _existing_file(spec, data_root)
    if path is not None:
        return _read_json_lines(path), str(path)
    if spec.hub is not None and not _offline():
        return _read_hub(spec, data_root / spec.files[0])
    raise MissingInputError(_missing_message(spec, data_root))


def local_file(name: str, data_root: str | Path) -> Path | None:
    """The benchmark's file under `data_root`, None when it is not on this machine (no hub look-up)."""
    return _existing_file(get_spec(name), Path(data_root))


def _existing_file(spec: BenchmarkSpec, data_root: Path) -> Path | None:
    return next((data_root / rel for rel in spec.files if (data_root / rel).is_file()), None)


def _offline() -> bool:
    return os.environ.get("HF_DATASETS_OFFLINE", "0") in ("1", "true", "True")


def _missing_message(spec: BenchmarkSpec, data_root: Path) -> str:
    tried = ", ".join(str(data_root / rel) for rel in spec.files)
    hub = (f" or go online (unset HF_DATASETS_OFFLINE) to use the hub copy {spec.hub.dataset!r}"
           if spec.hub else "")
    return (f"benchmark {spec.name!r}: no file at any of [{tried}] (eval.data_root={data_root}). Put its JSONL "
            f"at {data_root / spec.files[0]} with fields {spec.question_field!r} and {spec.answer_field!r}{hub}.")


def _read_json_lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines (also under a .json name, as HLE's top.json), or one JSON array; bad lines name file and line."""
    if not path.is_file():
        raise MissingInputError(f"benchmark file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BadInputError(f"benchmark file {path} cannot be read as UTF-8 text ({err}); fix or replace it") from err
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise BadInputError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); a file starting with '[' must be "
                                "one JSON list of rows") from err
    else:
        rows = read_jsonl(path)
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise BadInputError(f"{path} row {number}: expected a JSON object, got {type(row).__name__}")
    return rows


def _read_hub(spec: BenchmarkSpec, expected: Path) -> tuple[list[dict[str, Any]], str]:
    """The documented fallback: the hub copy, with its field names mapped onto the spec's."""
    import datasets

    hub = spec.hub
    assert hub is not None
    try:
        table = datasets.load_dataset(hub.dataset, hub.config, split=hub.split)
    except Exception as err:  # offline, gated (GAIA) or renamed: say what to do instead
        raise FileNotFoundError(f"benchmark {spec.name!r}: no file at {expected} and the hub copy {hub.dataset!r} "
                                f"could not be loaded ({type(err).__name__}: {err}). Put the JSONL file there.") from err
    rows = []
    for record in table:
        row = dict(record)
        row[spec.question_field] = record[hub.question_field]
        row[spec.answer_field] = record[hub.answer_field]
        if hub.id_field and spec.id_field:
            row[spec.id_field] = record[hub.id_field]
        if spec.name == "hle" and row.get("image"):
            row["has_image"] = True
        rows.append(row)
    return rows, f"hf://{hub.dataset}/{hub.config or ''}:{hub.split}"
