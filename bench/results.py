"""Bench results: one JSON file per bench, `bench/results/<name>.json`, and the tables of docs/benchmarks.md (and
docs/learning.md, the learning bench's page) made from them, so that every measured number lives in one place.

A bench script ends with `write_result(name, figures, ...)`: the figures it printed, with the date, the commit, the
load average and the machine, written atomically (a rerun replaces the file). A result says how it reads in one line
(`summary`, a format string over its figures) and may carry whole tables (`tables`). docs/benchmarks.md shows them
between markers: the summary table of every result between `<!-- bench-table:start -->` and
`<!-- bench-table:end -->`, and a result's table `T` between `<!-- bench-table:<name>/T:start -->` and
`<!-- bench-table:<name>/T:end -->`. tests/unit/test_bench_results.py fails when the page differs from the files.
A record superseded by a protocol it predates moves to `bench/results/history/` (git mv): its tables stay on the page
as `history/<name>/T`, and it leaves the summary table. Other folders under bench/results/ (a bench's working folders,
`per-question/`) hold no records.

    .venv/bin/python -m bench.results --write-docs    # rewrite the generated tables in docs/benchmarks.md, learning.md
    .venv/bin/python -m bench.results --check         # exit 1 when they are out of date
    .venv/bin/python -m bench.results                 # print the summary table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from stages.core.env import PROJECT_ROOT

RESULTS_DIR = PROJECT_ROOT / "bench" / "results"
HISTORY = "history"  # bench/results/history/: records kept for the page's history, not in the summary table
DOC = PROJECT_ROOT / "docs" / "benchmarks.md"  # the summary table's page
DOCS = (DOC, PROJECT_ROOT / "docs" / "learning.md")  # every page with generated tables
# `<!-- bench-table:start -->` (the summary) or `<!-- bench-table:[history/]<name>/<table>:start -->`, to its end
BLOCK = re.compile(r"<!-- bench-table(?P<tag>(?::(?:history/)?[\w.-]+/[\w.-]+)?):start -->\n(?P<body>.*?)"
                   r"<!-- bench-table(?P=tag):end -->", re.S)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def commit_state(ignore: tuple[str, ...] = ()) -> tuple[str | None, bool]:
    """The checkout's short commit, and whether tracked files differ from it (outside the `ignore` prefixes: a
    bench's own records, which it rewrites, are not the code it ran)."""
    changed = [path for path in (_git("diff", "--name-only", "HEAD") or "").splitlines()  # staged or not
               if not path.startswith(ignore)]
    return _git("rev-parse", "--short", "HEAD"), bool(changed)


def write_result(name: str, figures: dict[str, Any], *, summary: str, what: str, command: str,
                 details: str | None = None, conditions: dict[str, Any] | None = None,
                 tables: dict[str, dict[str, Any]] | None = None, root: Path = RESULTS_DIR,
                 provenance: tuple[str | None, bool] | None = None) -> Path:
    """Write `<root>/<name>.json` atomically and return its path.

    figures: the measured numbers (JSON values), named with their unit (`cold_s`, `quick_ms`, `ratio`).
    summary: one line for the summary table, a format string over the figures (`"cold {cold_s:.0f} s"`).
    what: what the bench measures, in a few words. command: how to run it again. details: the docs page (relative
    to docs/) with the full tables, e.g. `"agent.md#benchmarks"`. conditions: settings that shape the figures
    (profile, overrides, sizes). tables: `{"<table>": {"columns": [...], "rows": [[...], ...]}}` for the page.
    provenance: (commit, uncommitted changes) taken when the bench started, for a bench whose own outputs change the
    checkout before the record is written (default: the checkout now).
    """
    summary.format(**figures)  # a summary that names a missing figure fails here, not when the docs are written
    commit, dirty = provenance or commit_state()
    record = {"name": name, "what": what, "command": command, "summary": summary, "figures": figures,
              "conditions": conditions or {}, "details": details,
              "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
              "commit": commit, "uncommitted_changes": dirty,
              "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
              "source": f"measured: {command}"}
    if tables:
        record["tables"] = tables
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.json"
    with tempfile.NamedTemporaryFile("w", dir=root, prefix=f".{name}.", suffix=".tmp", delete=False) as tmp:
        tmp.write(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp.name, path)
    print(f"[bench] result written to {path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path}")
    return path


def load_results(root: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every result file directly under `root`, by name, in name order, then those under `root/history/` as
    `history/<name>`."""
    current = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(root.glob("*.json"))}
    return {**current, **{f"{HISTORY}/{p.stem}": json.loads(p.read_text(encoding="utf-8"))
                          for p in sorted((root / HISTORY).glob("*.json"))}}


def _load(record: dict[str, Any]) -> str:
    load = record.get("load_average")
    if isinstance(load, list) and load:
        return f"load {load[0]:.1f}"
    return f"load {load}" if load else "load not recorded"


def measured(record: dict[str, Any]) -> str:
    """When, at which commit and under what load, and where the record came from when not from a bench run."""
    if record.get("date"):
        when = record["date"]
    elif record.get("documented_by"):
        when = f"by {record['documented_by']}"
    else:
        when = "date not recorded"
    commit = record.get("commit")
    parts = [when, f"`{commit}`{' + edits' if record.get('uncommitted_changes') else ''}" if commit else None,
             _load(record)]
    text = ", ".join(p for p in parts if p)
    if not str(record.get("source", "")).startswith("measured"):
        text += f" (from {record['source']})"
    return text


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| bench | what | result | measured |", "|---|---|---|---|"]
    for name, record in results.items():
        if name.startswith(f"{HISTORY}/"):
            continue
        result = record["summary"].format(**record["figures"])
        if record.get("details"):
            result += f" ([details]({record['details']}))"
        rows.append(f"| `{record['command']}` | {_cell(record['what'])} | {_cell(result)} | {_cell(measured(record))} |")
    return "\n".join(rows) + "\n"


def result_table(record: dict[str, Any], table: str, name: str | None = None) -> str:
    spec = record["tables"][table]
    rows = ["| " + " | ".join(map(_cell, spec["columns"])) + " |", "|" + "---|" * len(spec["columns"])]
    rows += ["| " + " | ".join(map(_cell, row)) + " |" for row in spec["rows"]]
    return "\n".join(rows) + f"\n\n{measured(record)}; `{name or record['name']}` in bench/results/.\n"


def render(text: str, results: dict[str, dict[str, Any]]) -> str:
    """`text` with every bench-table block rewritten from `results`; a block naming no result is an error."""
    def block(match: re.Match) -> str:
        name = match.group("tag")[1:]
        if not name:
            body, tag = summary_table(results), ""
        else:
            result, _, table = name.rpartition("/")
            if table not in results.get(result, {}).get("tables", {}):
                raise KeyError(f"docs name the table {name!r}, which no file in bench/results/ holds")
            body, tag = result_table(results[result], table, result), f":{name}"
        return f"<!-- bench-table{tag}:start -->\n{body}<!-- bench-table{tag}:end -->"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true",
                        help=f"rewrite the tables in {', '.join(str(d.relative_to(PROJECT_ROOT)) for d in DOCS)}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the tables differ from the result files")
    args = parser.parse_args(argv)
    results = load_results()
    stale = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        want = render(text, results)
        if args.write_docs:
            if want != text:
                doc.write_text(want, encoding="utf-8")
            print(f"{doc.relative_to(PROJECT_ROOT)}: {'rewritten' if want != text else 'up to date'}")
        elif want != text:
            stale.append(doc)
    if args.check or args.write_docs:
        for doc in stale:
            print(f"{doc.relative_to(PROJECT_ROOT)} is out of date: run `python -m bench.results --write-docs`")
        return 1 if stale else 0
    sys.stdout.write(summary_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
