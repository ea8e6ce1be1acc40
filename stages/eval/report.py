"""The report stage: one row per scored benchmark (pandas), written as CSV + markdown, with the reference's
published numbers beside ours (stages/eval/reference_numbers.yaml, sources per entry).

All rates are percentages. `accuracy` is the paper's figure (llm_equal with a judge; else math_equal for math,
F1 for QA); pass@k columns use the unbiased estimator; `[lo, hi]` are seeded bootstrap intervals over questions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from stages.core.atomic import write_text
from stages.core.config.eval import EvalSection
from stages.core.fingerprint import code_version, hash_path, hash_value
from stages.core.refs import Ref, ScoresRef
from stages.core.workspace import stage_dir

STAGE = "eval-report"
REFERENCE_FILE = Path(__file__).with_name("reference_numbers.yaml")
_HEADLINE = ("benchmark", "questions", "samples", "metric", "accuracy", "accuracy ci", "em", "f1", "llm_equal",
             "judge_rule_agreement", "tool_calls", "tool_productivity")
_RATES = ("em", "f1", "acc", "math_equal", "llm_equal", "tool_use_rate", "judge_rule_agreement")


def load_reference_numbers(path: str | Path = REFERENCE_FILE) -> pd.DataFrame:
    """Published numbers as a table: setting, model, method, benchmark, metric, value, source."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    settings = data.get("settings") or {}
    rows = []
    for number, entry in enumerate(data.get("numbers") or [], start=1):
        missing = [k for k in ("setting", "benchmark", "metric", "value", "source") if k not in entry]
        if missing:
            raise ValueError(f"{path} numbers[{number}]: missing {missing}")
        if entry["setting"] not in settings:
            raise ValueError(f"{path} numbers[{number}]: setting {entry['setting']!r} is not declared under "
                             f"`settings:` (known: {sorted(settings)})")
        rows.append({**entry, **settings[entry["setting"]]})
    return pd.DataFrame(rows, columns=["setting", "model", "method", "benchmark", "metric", "value", "source"])


def report_rows(summaries: list[dict[str, Any]], reference: pd.DataFrame,
                reference_setting: str | None) -> list[dict[str, Any]]:
    """One flat row per benchmark summary (see scoring.summarize_benchmark), rates in percent."""
    if reference_setting is not None and reference_setting not in set(reference["setting"]):
        raise ValueError(f"eval.reference_setting={reference_setting!r} has no published numbers; choose one of "
                         f"{sorted(set(reference['setting']))} or null")
    ks = sorted({int(name.split("@")[1]) for s in summaries for name in s["metrics"] if name.startswith("pass@")})
    rows = []
    for summary in summaries:
        row: dict[str, Any] = {"benchmark": summary["benchmark"], "task_type": summary["task_type"],
                               "model": summary["model"], "questions": summary["questions"],
                               "samples": summary["samples_per_question"], "metric": summary["accuracy_metric"]}
        for name in ["accuracy", *(f"pass@{k}" for k in ks)]:
            value = summary["metrics"].get(name)
            row[name] = None if value is None else 100 * value["value"]
            row[f"{name} ci"] = None if value is None else f"[{100 * value['ci_low']:.1f}, {100 * value['ci_high']:.1f}]"
        for key in _RATES:
            value = summary.get(key)
            row[key] = None if value is None else 100 * value
        for key in ("tool_calls", "python_calls", "search_calls", "tool_productivity", "num_valid_answer",
                    "timed_out", "errors"):
            row[key] = summary.get(key)
        row |= _published(reference, summary["benchmark"], reference_setting)
        row["benchmark_hash"] = summary["benchmark_hash"]
        rows.append(row)
    return rows


def progress_rows(benchmarks: list[str], summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval table while it fills in: a row per configured benchmark, its headline numbers once scored."""
    rows = []
    for name in benchmarks:
        summary = summaries.get(name)
        if summary is None:
            rows.append({"benchmark": name, "status": "running"})
            continue
        metrics = {k: round(100 * v["value"], 2) for k, v in summary["metrics"].items()}
        rows.append({"benchmark": name, "status": "scored", "questions": summary["questions"],
                     "samples": summary["samples_per_question"], "metric": summary["accuracy_metric"], **metrics})
    return rows


def _published(reference: pd.DataFrame, benchmark: str, setting: str | None) -> dict[str, Any]:
    entries = reference[reference["benchmark"] == benchmark]
    if setting is not None:
        entries = entries[entries["setting"] == setting]
        return {f"paper {metric}": float(value)
                for metric, value in sorted(zip(entries["metric"], entries["value"]), key=lambda e: e[0])}
    text = "; ".join(f"{r.method} {r.model} {r.metric} {r.value:g}" for r in entries.itertuples())
    return {"published": text or None}


def render_markdown(table: pd.DataFrame, reference: pd.DataFrame, confidence: float) -> str:
    """The headline columns (the CSV has every column); published numbers in a second table with sources."""
    keep = [c for c in table.columns if c in _HEADLINE or c.startswith(("pass@", "paper ")) or c == "published"]
    shown = table[keep].round(2).astype(object).where(table[keep].notna(), None)  # missing -> "-"
    benchmarks = set(table["benchmark"])
    cited = reference[reference["benchmark"].isin(benchmarks)]
    legend = (f"Rates in percent; `accuracy` = llm_equal with a judge, else math_equal (math) / F1 (QA); pass@k by "
              f"the unbiased estimator; intervals are {confidence:.0%} bootstrap intervals over questions.")
    lines = ["# Evaluation report", "", legend, "", shown.to_markdown(index=False, missingval="-"), ""]
    if not cited.empty:
        lines += ["## Published numbers (reference work)", "", cited.to_markdown(index=False), ""]
    return "\n".join(lines)


def build_report(cfg: EvalSection, scores: list[ScoresRef], output_root: str | Path, force: bool = False) -> Ref:
    """CSV + markdown over the given scores; returns a Ref to the folder, rows in `meta["rows"]`."""
    if not scores:
        raise ValueError("build_report needs at least one ScoresRef; score a benchmark first")
    key = hash_value({"reference_setting": cfg.reference_setting, "confidence": cfg.confidence},
                     [s.fingerprint for s in scores], hash_path(REFERENCE_FILE), code_version("stages.eval"))
    out = stage_dir(output_root, STAGE, key, force=force)
    reference = load_reference_numbers()
    rows = report_rows([s.meta for s in scores], reference, cfg.reference_setting)
    if not out.complete:
        table = pd.DataFrame(rows)
        write_text(out.path / "report.csv", table.to_csv(index=False))
        write_text(out.path / "report.md", render_markdown(table, reference, cfg.confidence))
        out.finish()
    return Ref(path=str(out.path), fingerprint=out.fingerprint,
               meta={"csv": str(out.path / "report.csv"), "markdown": str(out.path / "report.md"), "rows": rows})
