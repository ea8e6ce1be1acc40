"""The learning bench's record (bench/bench_learning.py): headline figures, the descriptive and the protocol's tables,
the bench's wall time over every invocation that ran its runs, and the per-question file beside it
(bench/results/per-question/<record>.json) from which every figure and interval is recomputed.

A record is written only when every run of the design has its results, with the commit the invocation started on
(`provenance`: the bench's own outputs change the checkout before the record is written).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import RESULTS_DIR


def record_name(args: argparse.Namespace) -> str:
    """learning[-valid][-<tag>]: the confirmatory record is `learning`; a choice of setting is a `learning-valid-*`."""
    return "learning" + ("-valid" if args.split == "rl_valid" else "") + (f"-{args.tag}" if args.tag else "")


def pooled_sft(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """SFT's per-seed evaluations as one policy for the descriptive tables: per question the mean over seeds, and
    each seed's own (`correct_Q_by_seed`), which a run with that sampling seed is paired with."""
    from stages.core.passk import bootstrap_ci

    runs = sorted(runs, key=lambda r: r["seed"])
    questions = runs[0]["questions"]
    if any(r["questions"] != questions for r in runs):
        raise ValueError("SFT's seeds were evaluated on different questions; rerun them with the same --questions")
    correct_Q = np.mean([r["correct_Q"] for r in runs], axis=0)
    low, high = bootstrap_ci(correct_Q, samples=2000, confidence=0.95, seed=0)
    heldout = {key: float(np.mean([r["heldout"][key] for r in runs]))
               for key in ("accuracy", "format_valid", "tool_calls_per_traj", "mean_reward", "response_length")}
    return {**runs[0], "algorithm": "sft", "seed": None, "seeds": [r["seed"] for r in runs],
            "correct_Q": correct_Q.tolist(), "correct_Q_by_seed": {r["seed"]: r["correct_Q"] for r in runs},
            "heldout": {**runs[0]["heldout"], **heldout, "ci_low": low, "ci_high": high}}


def record_invocation(root: Path, args: argparse.Namespace, wall_s: float, ran: bool, commit: str | None,
                      interrupted: bool = False) -> None:
    """One line per invocation in <root>/invocations.jsonl: the bench's wall time adds up over resumed sessions (an
    interrupted invocation's too: its runs count, and so does its commit for the pin)."""
    line = {"record": record_name(args), "families": args.families, "wall_s": round(wall_s, 1), "ran_runs": ran,
            "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(root / "invocations.jsonl", "a") as handle:
        handle.write(json.dumps({**line, "interrupted": True} if interrupted else line) + "\n")


def invocations(root: Path, name: str) -> list[dict[str, Any]]:
    path = root / "invocations.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [line for line in lines if line["record"] == name]


def attempts_of(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The attempts (root/attempts.jsonl) of this record's tag and split."""
    path = root / "attempts.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [a for a in lines if a.get("tag", "") == args.tag and a.get("split", "eval_test") == args.split]


def bench_wall_min(root: Path, name: str) -> float:
    """Minutes of wall time of every invocation that ran runs of record `name` (reports alone add nothing)."""
    return round(sum(line["wall_s"] for line in invocations(root, name) if line["ran_runs"]) / 60, 1)


def pinned_commit(root: Path, args: argparse.Namespace, commit: str | None) -> str | None:
    """The commit an earlier invocation ran this record's runs on, when it is not `commit`: a design's runs all come
    from one commit (a later one keys SFT and RL anew: new policies mixed with old ones), so resuming on another is
    refused; a report of finished runs may come from any commit."""
    ran = [line.get("commit") for line in invocations(root, record_name(args)) if line["ran_runs"]]
    return next((c for c in ran if c and commit and c != commit), None)


def build_record(args: argparse.Namespace, root: Path, results: dict[str, dict[str, dict[str, Any]]],
                 summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write the per-question file of record `record_name(args)` and return the record's write_result arguments
    (name, figures, summary, what, details, conditions, tables); families run earlier into the same record are kept.
    results: per family, every run's results file by run id (`grpo:0`); summaries: per family, learning_report's.
    Every run's held-out answers and the invocation and attempt logs are committed beside it (bench/learning_archive.py).
    Headline figures and the protocol's tables are computed from the per-question file as written, so the record and
    a recomputation from the repository agree (tests/unit/test_learning_provenance.py)."""
    from learning_report import step_table

    from bench.learning_archive import reload_table, write_archive, write_logs
    from bench.learning_protocol import design_for, protocol_tables
    from bench.learning_questions import family_payload, headline_figures, read_per_question, write_per_question

    name = record_name(args)
    old = json.loads((RESULTS_DIR / f"{name}.json").read_text()) if (RESULTS_DIR / f"{name}.json").is_file() else {}
    tables = {k: v for k, v in old.get("tables", {}).items() if k.split("-")[0] not in results}
    for family, runs in results.items():
        summary = summaries[family]
        columns = list(summary["table"][0])
        tables[family] = {"columns": columns, "rows": [[row[c] for c in columns] for row in summary["table"]]}
        if summary.get("steps_vs_sft", {}).get("rows"):
            tables[f"{family}-steps-vs-sft"] = summary["steps_vs_sft"]
        tables[f"{family}-steps"] = step_table([r for r in runs.values() if r["algorithm"] != "sft"])
        tables[f"{family}-reload"] = reload_table(list(runs.values()))
    write_per_question(name, {family: family_payload(list(runs.values())) for family, runs in results.items()})
    archived = {family: write_archive(name, family, list(runs.values())) for family, runs in results.items()}
    logs = write_logs(name, invocations(root, name), attempts_of(root, args))
    per_question = read_per_question(name)
    figures: dict[str, Any] = headline_figures(per_question)
    tables.update(protocol_tables(per_question, design_for(args.split)))
    figures["bench_wall_min"] = bench_wall_min(root, name)
    families = sorted({k.split("_")[0] for k in figures if k.endswith("_sft")})
    trained = [a for a in args.algos.split(",") if a]  # none in an SFT-only record (`--algos ""`)
    policies = "; ".join(f"`{f}`: SFT {{{f}_sft:.3f}}" + "".join(
        f"{' -> ' if i == 0 else ', '}{a.upper()} {{{f}_{a}:.3f}}"
        for i, a in enumerate(x for x in trained if f"{f}_{x}" in figures)) for f in families)
    split = "validation split (rl_valid)" if args.split == "rl_valid" else "held-out test split"
    variant = f" ({args.tag}: {' '.join(args.override)})" if args.tag else ""
    return {"name": name, "figures": figures,
            "summary": f"accuracy on the {split}{variant}, {policies}; {{bench_wall_min:.0f}} min wall",
            "what": "does RL learn, does ARPO beat GRPO: GRPO / ARPO / AEPO from one SFT policy, the protocol's "
                    "endpoints" + (f"; variant {args.tag}" if args.tag else ""),
            "details": "learning.md",
            "conditions": {**merged_conditions(old.get("conditions", {}), list(results), {
                "algorithms": args.algos.split(","), "seeds": args.seeds.split(","),
                "control_seeds": [s for s in args.control_seeds.split(",") if s],
                "format_seeds": [s for s in getattr(args, "format_seeds", "").split(",") if s], "split": args.split,
                "steps": args.steps, "questions": args.questions, "samples": args.samples,
                "temperature": args.temperature, "backend": args.backend, "jobs": args.jobs, "tag": args.tag,
                "overrides": args.override}, f"bench/results/per-question/{name}.json"),
                "predictions": {**old.get("conditions", {}).get("predictions", {}), **archived}, "logs": logs},
            "tables": tables}


def merged_conditions(old: dict[str, Any], ran: list[str], this: dict[str, Any], per_question: str) -> dict[str, Any]:
    """The record's conditions: per family those of the invocation that ran it (`by_family`), so a later run of
    one family (the exploratory arm, say) keeps the other's seeds and settings; the top level is this
    invocation's."""
    by_family = {family: {k: v for k, v in old.items() if k not in ("families", "by_family", "per_question")}
                 for family in old.get("families", [])}
    by_family.update(old.get("by_family", {}))
    by_family.update({family: this for family in ran})
    return {"families": sorted(by_family), **this, "per_question": per_question, "by_family": by_family}


def descriptive_gain_cells(family: Any, policy: str) -> dict[str, str]:
    """A policy's "gain vs SFT" and "mean gain [95%]" cells of the descriptive table, recomputed from the
    per-question file (`Family`): each run paired with SFT's evaluation of its own seed, as the report pairs them."""
    from bench.learning_questions import SFT, paired
    from bench.learning_report import gain_cells, gain_summary

    seeds, rl, sft = paired(family, policy, SFT)
    return gain_cells(gain_summary([(s, (b.correct / b.samples).tolist(), (a.correct / a.samples).tolist())
                                    for s, a, b in zip(seeds, rl, sft)]))


def regenerate_tables(name: str, root: Path = RESULTS_DIR) -> Path:
    """Rewrite what the code generates in record `name` from its committed per-question file alone: the protocol's
    tables, and the gain cells of each family's descriptive table. Everything else (figures, commit, date,
    conditions, the runs' steps) stays as the run wrote it: the record is history, its rendering follows the code."""
    from bench.learning_protocol import design_for, protocol_tables
    from bench.learning_questions import read_per_question
    from stages.core.atomic import write_text

    path = root / f"{name}.json"
    record = json.loads(path.read_text())
    per_question = read_per_question(name)
    record["tables"].update(protocol_tables(per_question, design_for(record["conditions"]["split"])))
    for family_name, family in per_question.items():
        table = record["tables"].get(family_name)
        if table is None:
            continue
        policy_col = table["columns"].index("policy")
        for row in table["rows"]:
            policy = row[policy_col].split(" (")[0]
            if policy.lower() == "sft":
                continue
            for column, cell in descriptive_gain_cells(family, policy).items():
                row[table["columns"].index(column)] = cell
    write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path
