"""Paper parity: per benchmark, ours beside the published number of the same checkpoint, the gap with its
interval, and every evaluation setting of ours that differs from the paper's.

The published numbers and the paper's evaluation settings live in stages/eval/reference_numbers.yaml (a setting's
`eval:` block and its released `checkpoints`; their upstream sources in docs/reference.md "Published numbers").
The gap is ours minus the published number, in points; its interval is our bootstrap interval over questions
shifted by the published number (the paper states no interval, so its number is taken as exact: the interval is
ours alone, and a gap whose interval holds 0 is within our sampling noise). A row is flagged with each difference
in what was compared (the measure, the model) and in how (sampling, samples, judge, search, questions), read from
the run's own records (stages/eval/report_provenance.py), never from the config alone.
"""

from __future__ import annotations

from typing import Any

# the sampling the inference stage records (stages/eval/provenance.py) that the paper's settings may state
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "samples", "max_tokens")
PARITY_HEADING = "## Paper parity"


def setting_differences(paper: dict[str, Any], summary: dict[str, Any], provenance: dict[str, Any],
                        max_questions: int | None) -> list[str]:
    """How this benchmark's evaluation differs from the paper's (empty: the same in everything stated)."""
    evaluation, out = paper.get("eval") or {}, []
    checkpoints = paper.get("checkpoints") or []
    served = f"{provenance.get('policy_path') or ''} {provenance.get('served_as') or summary.get('model') or ''}"
    if checkpoints and not any(c.split("/")[-1].lower() in served.lower() for c in checkpoints):
        out.append(f"policy `{provenance.get('served_as') or summary.get('model')}`, not the released "
                   f"{' / '.join(checkpoints)}")
    if not provenance.get("inference_recorded"):
        out.append("sampling not recorded (predictions made before the inference record was kept)")
    else:
        for key in SAMPLING:
            if key in evaluation and not _same(provenance.get(key), evaluation[key]):
                ours = provenance.get(key)
                out.append(f"{key} {'not sent' if ours is None else f'{ours:g}'} (paper {evaluation[key]:g})")
    if "judge" in evaluation:
        ours = " ".join(str(provenance.get(k) or "") for k in ("judge_path", "judge_name")).strip() \
            or str(summary.get("judge") or "")
        if evaluation["judge"].lower() not in ours.lower():
            out.append(f"judge {ours or 'none (rule metrics)'} (paper {evaluation['judge']})")
    search = evaluation.get("search")
    expected = search.get(summary["benchmark"]) if isinstance(search, dict) else search
    mode = str(summary.get("search_mode") or "")
    if expected and mode.split(" ")[0] != expected and summary.get("task_type") != "math":
        out.append(f"search {mode or 'not recorded'} (paper {expected})")
    cap = evaluation.get("max_questions")
    if max_questions is not None and (cap is None or max_questions < cap):
        out.append(f"the first {max_questions} questions (paper: {f'up to {cap}' if cap else 'all'})")
    return out


def _same(ours: Any, paper: Any) -> bool:
    return ours is not None and abs(float(ours) - float(paper)) < 1e-9


def parity_rows(summaries: list[dict[str, Any]], reference: Any, setting: str, paper: dict[str, Any],
                provenance: list[dict[str, Any]], max_questions: int | None) -> list[dict[str, Any]]:
    """One row per published number of `setting` on a benchmark we scored (`reference`: report's table)."""
    by_benchmark = {row["benchmark"]: row for row in provenance}
    entries = reference[reference["setting"] == setting]
    rows = []
    for summary in summaries:
        differs = setting_differences(paper, summary, by_benchmark.get(summary["benchmark"], {}), max_questions)
        base = paper.get("base_model")
        served = str(summary.get("model", "")).lower()
        other_model = base and base.lower() not in served and not any(
            c.split("/")[-1].lower() in served for c in paper.get("checkpoints") or [])
        for entry in entries[entries["benchmark"] == summary["benchmark"]].sort_values("metric").itertuples():
            k = int(entry.metric.split("@")[1])
            ours = summary["metrics"].get("accuracy" if k == 1 else entry.metric)
            measure = summary["accuracy_metric"] if k == 1 else summary.get("correct_metric")
            flags = list(differs)
            if measure != entry.measure:
                flags.insert(0, f"measure {measure} (paper {entry.measure})")
            if other_model:
                flags.insert(0, f"the published number is {base}'s")
            row: dict[str, Any] = {"benchmark": summary["benchmark"], "metric": f"{entry.metric} {entry.measure}",
                                   "questions x samples": f"{summary['questions']} x {summary['samples_per_question']}",
                                   "published": float(entry.value), "source": entry.source}
            if ours is None:
                flags.insert(0, f"{entry.metric} not computed (eval.samples < {k} or not in eval.pass_k)")
                row |= {"ours": None, "ours ci": None, "gap": None, "gap ci": None, "verdict": "-"}
            else:
                value, low, high = (100 * ours[key] for key in ("value", "ci_low", "ci_high"))
                gap_low, gap_high = low - entry.value, high - entry.value
                row |= {"ours": value, "ours ci": f"[{low:.1f}, {high:.1f}]", "gap": value - entry.value,
                        "gap ci": f"[{gap_low:+.1f}, {gap_high:+.1f}]",
                        "verdict": "within" if gap_low <= 0 <= gap_high else "below" if gap_high < 0 else "above"}
            row["differs from the paper"] = "; ".join(flags) or "nothing stated"
            rows.append(row)
    return rows


def render_parity(rows: list[dict[str, Any]], setting: str, paper: dict[str, Any], confidence: float) -> list[str]:
    """The report's parity section: the table, or why there is none."""
    import pandas as pd

    who = f"{paper.get('method', '')} {paper.get('model', '')}".strip()
    released = ", ".join(f"`{c}`" for c in paper.get("checkpoints") or []) or "none named"
    evaluation = paper.get("eval") or {}
    stated = ", ".join(f"{k} {v}" for k, v in evaluation.items() if k != "source") or "none stated here"
    lines = [f"{PARITY_HEADING}: {setting} ({who})", "",
             f"Released checkpoint: {released}. The paper's evaluation settings: {stated}"
             + (f" ({evaluation['source']})" if evaluation.get("source") else "") + ".", ""]
    if not rows:
        return [*lines, f"No published number of {setting} is known here for the benchmarks scored "
                        "(docs/reference.md \"Published numbers\": the README tables are images).", ""]
    table = pd.DataFrame(rows).drop(columns="source").round(2).astype(object)
    lines += [f"`ours`: this run, in percent, with its {confidence:.0%} bootstrap interval over questions. `gap` = ours "
              "- published, in points; `gap ci` is our interval shifted by the published number (the paper states "
              "none); `verdict`: `within` when that interval holds 0. `differs from the paper`: each setting of "
              "this run that is not the paper's, read from the run's records.", "",
              table.where(table.notna(), None).to_markdown(index=False, missingval="-"), ""]
    return lines


def parity_section(markdown: str) -> str:
    """The parity section of a report's markdown ('' when it has none), for `arpo run` to print."""
    start = markdown.find(PARITY_HEADING)
    if start < 0:
        return ""
    end = markdown.find("\n## ", start + len(PARITY_HEADING))
    return markdown[start:end if end >= 0 else None].rstrip() + "\n"
