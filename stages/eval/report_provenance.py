"""The provenance block at the top of the evaluation report, and its CSV side file (`provenance.csv`), read from
the run's own records: each benchmark's score summary, which carries the inference stage's record of the predictions
(`inference`), the judge as served (`judge_served`) and the scoring's commit and date (`scored`) (stages/eval/
provenance.py), plus the report's own commit and date and the eval config it was keyed on (the bootstrap seed).

A value that is the same for every benchmark is shown once; one that differs is listed with the benchmarks it
belongs to (`a (aime24, math500); b (hotpotqa)`). A record a benchmark does not have is `not recorded`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from stages.core.provenance import NOT_RECORDED

PROVENANCE_CSV = "provenance.csv"
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "samples", "max_tokens",
             "max_total_tokens")
_SEARCH = ("backend", "mode", "top_k", "replay_file", "corpus", "server_url", "web", "pages_replay_file",
           "summarizer")


def provenance_rows(summaries: list[dict[str, Any]], report: dict[str, Any],
                    bootstrap_seed: int) -> list[dict[str, Any]]:
    """One flat row per benchmark (the CSV side file): who made its predictions, with what, judged by whom."""
    rows = []
    for summary in summaries:
        made = summary.get("inference") or {}
        policy, search, sampling = made.get("policy") or {}, made.get("search") or {}, made.get("sampling") or {}
        judge, scored = summary.get("judge_served") or {}, summary.get("scored") or {}
        rows.append({
            "benchmark": summary["benchmark"],
            **{f"policy_{k}": policy.get(k) for k in ("path", "stage", "key", "fingerprint")},
            "served_as": made.get("served_as", summary.get("model")),
            "predictions_commit": made.get("commit"), "predictions_dirty": made.get("dirty"),
            "predictions_date": made.get("date"),
            **{f"search_{k}": search.get(k) for k in _SEARCH},
            **{k: sampling.get(k) for k in _SAMPLING}, "seeds": made.get("seeds"), "bootstrap_seed": bootstrap_seed,
            **{f"judge_{k}": judge.get(k) for k in ("name", "path", "fingerprint", "backend", "shared_with")},
            "judge_answered_as": _counts(judge.get("answered_as")) if judge else None,
            "judge_identity": summary.get("judge"),
            "scored_commit": scored.get("commit"), "scored_dirty": scored.get("dirty"), "scored_date": scored.get("date"),
            "report_commit": report.get("commit"), "report_dirty": report.get("dirty"), "report_date": report.get("date"),
            "inference_recorded": bool(made)})
    return rows


def render_provenance(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown block (a heading and a two-column table) over `provenance_rows`."""
    # (field, how a row shows it, whether it needs the inference record: predictions made before it was kept)
    fields = [("policy", _policy, True), ("served as", lambda r: _code(r["served_as"]), False),
              ("predictions", lambda r: _made(r, "predictions"), True), ("scores", lambda r: _made(r, "scored"), False),
              ("report", lambda r: _made(r, "report"), False), ("judge", _judge, False), ("search", _search, True),
              ("sampling", _sampling, True),
              ("seeds", lambda r: f"{r['seeds']}; bootstrap intervals: seed {r['bootstrap_seed']}", True)]
    lines = ["## Provenance", "",
             "What produced these numbers, as the run recorded it (each benchmark's inference and score records, "
             "the report stage); a value that differs between benchmarks is listed with its benchmarks.", "",
             "| | |", "|---|---|"]
    lines += [f"| {name} | {_grouped(rows, show, needs)} |" for name, show, needs in fields]
    return [*lines, ""]


def _grouped(rows: list[dict[str, Any]], show: Any, needs_record: bool) -> str:
    by_value: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        shown = show(row) if row["inference_recorded"] or not needs_record else NOT_RECORDED
        by_value[shown].append(row["benchmark"])
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{value} ({', '.join(names)})" for value, names in by_value.items())


def _code(value: Any) -> str:
    return f"`{value}`" if value not in (None, "") else NOT_RECORDED


def _made(row: dict[str, Any], prefix: str) -> str:
    commit, dirty, date = row[f"{prefix}_commit"], row[f"{prefix}_dirty"], row[f"{prefix}_date"]
    state = "" if dirty is None else " + uncommitted changes" if dirty else ", tracked files unchanged"
    return f"commit {_code(commit)}{state}, {date or 'date ' + NOT_RECORDED}"


def _policy(row: dict[str, Any]) -> str:
    where = f"stage `{row['policy_stage']}`, key `{row['policy_key']}`" if row["policy_stage"] else \
        "not a folder this pipeline's stages wrote"
    return f"{_code(row['policy_path'])} ({where}; fingerprint {_code(row['policy_fingerprint'])})"


def _judge(row: dict[str, Any]) -> str:
    if row["judge_name"] is None:
        identity = row["judge_identity"]
        return f"{_code(identity)} (as served: {NOT_RECORDED})" if identity else "none: rule metrics only"
    served = "the policy's server" if row["judge_shared_with"] else \
        f"{_code(row['judge_path'])} ({row['judge_backend'] or 'backend ' + NOT_RECORDED}, fingerprint " \
        f"{_code(row['judge_fingerprint'])})"
    return f"{_code(row['judge_name'])} served from {served}; answered as {row['judge_answered_as'] or 'no verdict'}"


def _search(row: dict[str, Any]) -> str:
    parts = [f"backend `{row['search_backend']}`, top {row['search_top_k']}, {row['search_mode']}"]
    for key, label in (("replay_file", "replay file"), ("corpus", "corpus"), ("server_url", "server"),
                       ("web", "web"), ("pages_replay_file", "recorded pages"), ("summarizer", "summariser")):
        if row[f"search_{key}"]:
            parts.append(f"{label} `{row[f'search_{key}']}`")
    return ", ".join(parts)


def _sampling(row: dict[str, Any]) -> str:
    sent = [f"{k} {row[k]:g}" for k in ("temperature", "top_p", "top_k", "min_p",
                                                           "repetition_penalty") if row[k] is not None]
    return (", ".join(sent) + f"; {row['samples']} sample{'s' * (row['samples'] != 1)} per question; max_tokens "
            f"{row['max_tokens']} per call, {row['max_total_tokens']} per sample")


def _counts(answered: dict[str, int] | None) -> str | None:
    if not answered:
        return None
    return "; ".join(f"{model} ({n} verdict{'s' * (n != 1)})" for model, n in answered.items())
