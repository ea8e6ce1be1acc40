"""The report stage: one row per scored benchmark (pandas), written as CSV + markdown, with the reference's
published numbers beside ours (stages/eval/reference_numbers.yaml, sources per entry).

All rates are percentages. `accuracy` is each benchmark's headline metric as the papers report it (`metric`
column: F1 for the knowledge-QA sets, llm_equal for the others; without a judge llm_equal falls back to math_equal
/ F1 and the column says so); pass@k columns count a binary verdict (`pass@k verdict`: llm_equal with a judge,
else math_equal / EM) with the unbiased estimator; `[lo, hi]` are seeded bootstrap intervals over questions.
`search` says how each benchmark's answers searched (snippets, browse or browse+summary, and the browsing tool's
language; stages/eval/search_mode.py), beside the published numbers. A published number goes into `paper accuracy`
/ `paper pass@k` only when it measures the same thing as our column beside it; otherwise it is listed under `paper
(other metric)`. The judge's own figure (`llm_equal`) and its agreement with the rules sit next to the headline.
`provider failures` counts the answers whose tool calls hit an infrastructure failure (search provider, retrieval
server, sandbox): they are left out of the metrics with the rest of their question's samples, listed under their
own heading, and retried by the next run. At the top, the provenance block says what produced the numbers (policy,
commits, judge as served, search, sampling, seeds, dates), read from the stages' records; `provenance.csv` holds
it per benchmark (stages/eval/report_provenance.py). With `eval.reference_setting`, the parity section (and
`parity.csv`) puts ours beside each published number of that setting with the gap, its interval and every setting
that differs from the paper's evaluation (stages/eval/parity.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from stages.core.atomic import write_text
from stages.core.codeversion import code_version
from stages.core.config.eval import EvalSection
from stages.core.fingerprint import hash_path, hash_value
from stages.core.provenance import git_state, utc_now
from stages.core.refs import Ref, ScoresRef
from stages.core.workspace import stage_dir
from stages.eval.parity import parity_rows, render_parity
from stages.eval.report_provenance import PROVENANCE_CSV, provenance_rows, render_provenance

if TYPE_CHECKING:  # pandas is imported where a table is built: computing the key (a cached run) needs none
    import pandas as pd

STAGE = "report"
REFERENCE_FILE = Path(__file__).with_name("reference_numbers.yaml")
PARITY_CSV = "parity.csv"
_HEADLINE = ("benchmark", "search", "questions", "samples", "metric", "accuracy", "accuracy ci", "paper accuracy",
             "pass@k verdict", "llm_equal", "judge_rule_agreement", "em", "f1", "paper (other metric)", "published",
             "tool_calls", "tool_productivity", "debug_uses", "rollback_uses", "refine_uses", "provider failures")
_RATES = ("em", "f1", "acc", "math_equal", "llm_equal", "tool_use_rate", "judge_rule_agreement")


def load_reference_numbers(path: str | Path = REFERENCE_FILE) -> pd.DataFrame:
    """Published numbers as a table: setting, model, method, benchmark, metric, value, source."""
    import pandas as pd

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    settings = data.get("settings") or {}
    rows = []
    for number, entry in enumerate(data.get("numbers") or [], start=1):
        missing = [k for k in ("setting", "benchmark", "metric", "measure", "value", "source") if k not in entry]
        if missing:
            raise ValueError(f"{path} numbers[{number}]: missing {missing}")
        if entry["setting"] not in settings:
            raise ValueError(f"{path} numbers[{number}]: setting {entry['setting']!r} is not declared under "
                             f"`settings:` (known: {sorted(settings)})")
        rows.append({**entry, **settings[entry["setting"]]})
    return pd.DataFrame(rows, columns=["setting", "model", "method", "base_model", "checkpoints", "benchmark", "metric",
                                       "measure", "value", "source"])


def load_reference_settings(path: str | Path = REFERENCE_FILE) -> dict[str, dict[str, Any]]:
    """The declared settings: model, method, `base_model`, the released `checkpoints` and the paper's `eval`."""
    return dict(yaml.safe_load(Path(path).read_text(encoding="utf-8")).get("settings") or {})


def report_rows(summaries: list[dict[str, Any]], reference: pd.DataFrame, reference_setting: str | None,
                declared: set[str] | None = None) -> list[dict[str, Any]]:
    """One flat row per benchmark summary (see scoring.summarize_benchmark), rates in percent, published numbers
    beside the column that measures the same thing. `declared`: the settings that may be named (default: those
    with numbers; a released checkpoint whose numbers are not known here is declared without any)."""
    known = set(reference["setting"]) | (declared or set())
    if reference_setting is not None and reference_setting not in known:
        raise ValueError(f"eval.reference_setting={reference_setting!r} has no published numbers; choose one of "
                         f"{sorted(known)} or null")
    ks = sorted({int(name.split("@")[1]) for s in summaries for name in s["metrics"] if name.startswith("pass@")})
    rows = []
    for summary in summaries:
        same, other = _published(reference, summary, reference_setting)
        row: dict[str, Any] = {"benchmark": summary["benchmark"], "search": summary.get("search_mode"),
                               "task_type": summary["task_type"],
                               "model": summary["model"], "questions": summary["questions"],
                               "samples": summary["samples_per_question"], "metric": summary["accuracy_metric"]}
        for name in ["accuracy", *(f"pass@{k}" for k in ks)]:
            value = summary["metrics"].get(name)
            row[name] = None if value is None else 100 * value["value"]
            row[f"{name} ci"] = None if value is None else f"[{100 * value['ci_low']:.1f}, {100 * value['ci_high']:.1f}]"
            if reference_setting is not None:
                paper = "paper accuracy" if name == "accuracy" else f"paper {name}"
                row[paper] = same.pop(paper, None)
        row |= same  # published pass@k of a k we did not sample
        row["pass@k verdict"] = summary.get("correct_metric")
        for key in _RATES:
            value = summary.get(key)
            row[key] = None if value is None else 100 * value
        row |= other
        for key in ("tool_calls", "python_calls", "search_calls", "tool_productivity", "num_valid_answer",
                    "timed_out", "errors", "debug_uses", "rollback_uses", "refine_uses"):
            row[key] = summary.get(key)
        row["provider failures"] = summary.get("infra_failed_answers", 0)
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
        failed = summary.get("infra_failed_answers", 0)
        rows.append({"benchmark": name, "status": "scored", "questions": summary["questions"],
                     "samples": summary["samples_per_question"], "metric": summary["accuracy_metric"], **metrics,
                     **({"provider failures": failed} if failed else {})})
    return rows


def _published(reference: pd.DataFrame, summary: dict[str, Any], setting: str | None
               ) -> tuple[dict[str, float], dict[str, Any]]:
    """({"paper accuracy" | "paper pass@k": value} for entries measuring what our column measures,
    {"paper (other metric)" | "published": text} for the rest). A pass@1 entry compares with our accuracy (both
    are means over samples of the per-sample measure), a pass@k entry (k > 1) with our pass@k verdicts."""
    entries = reference[reference["benchmark"] == summary["benchmark"]]
    if setting is None:
        text = "; ".join(f"{r.method} {r.model} {r.metric} {r.measure} {r.value:g}" for r in entries.itertuples())
        return {}, {"published": text or None}
    ours = {"pass@1": summary["accuracy_metric"]}
    same: dict[str, float] = {}
    other = []
    mine_only = entries[entries["setting"] == setting]
    base = next((b for b in mine_only["base_model"] if isinstance(b, str) and b), None)
    released = next((c for c in mine_only["checkpoints"] if isinstance(c, list)), [])
    served = str(summary.get("model", "")).lower()
    if base is not None and base.lower() not in served and not any(c.split("/")[-1].lower() in served
                                                                   for c in released):
        # numbers of another model size: not comparable (the README's other sizes are an image)
        return {}, {"paper (other metric)": f"{setting}'s numbers are {base}'s; this run served {summary.get('model')}"
                    " (no published number for it here)" if len(mine_only) else None}
    for r in mine_only.sort_values("metric").itertuples():
        mine = ours.get(r.metric, summary.get("correct_metric"))
        if r.measure == mine:
            same["paper accuracy" if r.metric == "pass@1" else f"paper {r.metric}"] = float(r.value)
        else:
            other.append(f"{r.metric} {r.measure} {r.value:g} (ours: {mine})")
    return same, {"paper (other metric)": "; ".join(other) or None}


def render_markdown(table: pd.DataFrame, reference: pd.DataFrame, confidence: float,
                    provenance: list[str] | None = None) -> str:
    """The provenance block (`render_provenance`'s lines), the headline columns (the CSV has every column);
    published numbers in a second table with sources."""
    keep = [c for c in table.columns if c in _HEADLINE or c.startswith(("pass@", "paper "))]
    shown = table[keep].round(2).astype(object).where(table[keep].notna(), None)  # missing -> "-"
    benchmarks = set(table["benchmark"])
    cited = reference[reference["benchmark"].isin(benchmarks)].drop(columns=["base_model", "checkpoints"])
    legend = (f"Rates in percent. `accuracy` = each benchmark's headline metric as the papers report it (`metric`: "
              f"F1 for HotpotQA, 2Wiki, MuSiQue, Bamboogle; llm_equal, the judge, for the others; without a judge "
              f"math_equal / F1 stand in and the column says so). pass@k counts the `pass@k verdict` with the "
              f"unbiased estimator. `paper ...` columns hold published numbers of the same metric only; others are "
              f"under `paper (other metric)`. `llm_equal` is the judge beside the headline. `debug_uses`, "
              f"`rollback_uses`, `refine_uses`: Tool-Star's inference-time tools used (totals over the samples; "
              f"agent.inference). `search` = how the answers searched: `snippets` (the search results' text), "
              f"`browse` (the result pages read, the passage around the best-matching sentence) or `browse+summary` "
              f"(those pages condensed by the summariser model), with the browsing tool's language variant; the "
              f"reference's evaluation scripts run with browse+summary (completion_sds; docs/reference.md, "
              f"\"Deep-search browsing\"). Intervals are "
              f"{confidence:.0%} bootstrap intervals over questions.")
    lines = ["# Evaluation report", "", *(provenance or []), legend, "", shown.to_markdown(index=False,
                                                                                          missingval="-"), ""]
    if not cited.empty:
        lines += ["## Published numbers (reference work)", "", cited.to_markdown(index=False), ""]
    return "\n".join(lines)


def render_infra(summaries: list[dict[str, Any]]) -> list[str]:
    """One line per benchmark whose answers hit a provider (infrastructure) failure; nothing when none did."""
    hit = [s for s in summaries if s.get("infra_failed_answers")]
    if not hit:
        return []
    lines = ["## Answers that hit a provider failure", "",
             "A tool call of these answers failed in the environment (search provider, retrieval server or sandbox), "
             "not by the model's doing. They are not scored wrong: their questions are left out of the metrics above, "
             "and the next run of the pipeline retries only these samples.", ""]
    for s in hit:
        shown = ", ".join(s.get("infra_failed", [])[:10])
        more = s["infra_failed_answers"] - min(10, len(s.get("infra_failed", [])))
        answers, questions = s["infra_failed_answers"], s["infra_failed_questions"]
        lines.append(f"- **{s['benchmark']}**: {answers} answer{'s' * (answers != 1)} hit a provider failure "
                     f"({questions} question{'s' * (questions != 1)} left out): {shown}"
                     + (f" and {more} more" if more > 0 else ""))
    return [*lines, ""]


def report_key(cfg: EvalSection, scores: list[ScoresRef], gains: dict[str, ScoresRef] | None = None) -> str:
    """The stage's one key (its folder name and its Prefect cache key)."""
    return hash_value({"reference_setting": cfg.reference_setting, "confidence": cfg.confidence},
                      [s.fingerprint for s in scores], {k: v.fingerprint for k, v in (gains or {}).items()},
                      hash_path(REFERENCE_FILE), code_version(__name__))


def stage_gain_rows(gains: dict[str, ScoresRef]) -> list[dict[str, Any]]:
    """One row per policy (base, sft, rl: the order given), its held-out accuracy with the interval, and the change
    from the row before it: what that stage bought."""
    rows, previous = [], None
    for label, ref in gains.items():
        m = ref.meta
        rows.append({"policy": label, "accuracy": 100 * m["accuracy"],
                     "ci": f"[{100 * m['ci_low']:.1f}, {100 * m['ci_high']:.1f}]",
                     "change": None if previous is None else 100 * (m["accuracy"] - previous),
                     "format valid": 100 * m["format_valid"], "tool calls / traj": m["tool_calls_per_traj"],
                     "questions x samples": f"{m['questions']} x {m['samples']}"})
        previous = m["accuracy"]
    return rows


def render_gains(gains: dict[str, ScoresRef], confidence: float) -> list[str]:
    if not gains:
        return []
    import pandas as pd

    first = next(iter(gains.values()))
    table = pd.DataFrame(stage_gain_rows(gains)).round(2).astype(object)
    return ["## What each stage bought (held-out split)", "",
            f"Each policy on the same {first.benchmark} questions of this run's data stage, in process with the same "
            f"tools (stage `heldout`; temperature {first.meta['temperature']:g}). Accuracy in percent, "
            f"{confidence:.0%} bootstrap interval over questions; `change` = accuracy minus the row above.", "",
            table.where(table.notna(), None).to_markdown(index=False, missingval="-"), ""]


def build_report(cfg: EvalSection, scores: list[ScoresRef], output_root: str | Path,
                 gains: dict[str, ScoresRef] | None = None, force: bool = False) -> Ref:
    """CSV + markdown over the given scores; returns a Ref to the folder, rows in `meta["rows"]`."""
    if not scores:
        raise ValueError("build_report needs at least one ScoresRef; score a benchmark first")
    out = stage_dir(output_root, STAGE, report_key(cfg, scores, gains), force=force)
    reference, settings = load_reference_numbers(), load_reference_settings()
    rows = report_rows([s.meta for s in scores], reference, cfg.reference_setting, set(settings))
    if not out.complete:
        import pandas as pd

        table = pd.DataFrame(rows)
        write_text(out.path / "report.csv", table.to_csv(index=False))
        provenance = provenance_rows([s.meta for s in scores], {**git_state(), "date": utc_now()},
                                     cfg.bootstrap_seed)
        write_text(out.path / PROVENANCE_CSV, pd.DataFrame(provenance).to_csv(index=False))
        markdown = render_markdown(table, reference, cfg.confidence, render_provenance(provenance))
        parity = []
        if cfg.reference_setting is not None:  # the checkpoint against its paper (stages/eval/parity.py)
            paper = settings[cfg.reference_setting]
            parity_table = parity_rows([s.meta for s in scores], reference, cfg.reference_setting, paper, provenance,
                                       cfg.max_questions)
            write_text(out.path / PARITY_CSV, pd.DataFrame(parity_table).to_csv(index=False))
            parity = render_parity(parity_table, cfg.reference_setting, paper, cfg.confidence)
        write_text(out.path / "report.md", "\n".join([markdown, *parity, *render_infra([s.meta for s in scores]),
                                                      *render_gains(gains or {}, cfg.confidence)]))
        out.finish()
    return Ref(path=str(out.path), fingerprint=out.fingerprint,
               meta={"csv": str(out.path / "report.csv"), "markdown": str(out.path / "report.md"),
                     "provenance": str(out.path / PROVENANCE_CSV), "rows": rows,
                     "stage_gains": stage_gain_rows(gains or {}),
                     "parity": str(out.path / PARITY_CSV) if cfg.reference_setting is not None else None})
