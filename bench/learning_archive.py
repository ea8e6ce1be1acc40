"""What a learning record's figures come from, committed beside it (issue 54): every held-out answer of every run,
compressed, and the invocation and attempt logs of the runs.

- `bench/results/predictions/<record>/<family>.jsonl.gz`: one line per run and question, `{"run": "grpo-s0", "q": 17,
  "answer": ..., "ability": ..., "responses": [...], "correct": [...], "formed": [...], "calls": [...],
  "content": [...]}` (one entry per sample), written byte for byte reproducibly (gzip without a timestamp, runs in
  order); its sha256 is in the record's conditions (`predictions`). The per-question file's counts are these
  verdicts summed (`archive_problems` checks that, and the hash: tests/unit/test_learning_provenance.py), and
  `regrade` grades the responses again with the eval stage's code.
- `bench/results/logs/<record>.jsonl`: the bench's invocations (wall time, commit) and its runs' attempts (exit, wall
  and CPU time, timeouts) that made the record.
- Per RL run, `reload_check`: the trainer's log-probs on the fixed parity probe at its last step (probe.json, written
  with the final checkpoint: stages/rl/probe.py) against the policy reloaded from its files as the evaluation loads
  it. The lr = 0 control proves the evaluation deterministic; it cannot catch a save/reload bug in weights that did
  change (a tied LM head saved or loaded wrong), which moves these numbers.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path
from typing import Any

from bench.learning_questions import FIELDS, OPTIONAL_FIELDS, Family, run_id
from bench.results import PROJECT_ROOT, RESULTS_DIR

ARCHIVE_DIR = RESULTS_DIR / "predictions"
LOG_DIR = RESULTS_DIR / "logs"
RELOAD_ATOL = 1e-4  # the merge stage's parity tolerance (rl.merge.parity_atol): fp32 on one device agrees far closer


def archive_lines(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's lines from its held-out predictions (stages/heldout) and its results file's content verdicts."""
    from stages.core.atomic import read_jsonl

    rows = read_jsonl(Path(result["heldout_path"]).with_name("predictions.jsonl"))
    content = result.get("content_QN") or [[None] * len(row["responses"]) for row in rows]
    return [{"run": run_id(result), "q": q, "answer": row["answer"], "ability": row["ability"],
             "responses": row["responses"], "correct": [bool(x) for x in row["correct"]],
             "formed": [bool(x) for x in row["format_ok"]], "calls": [int(x) for x in row["tool_calls"]],
             "content": content[q]} for q, row in enumerate(rows)]


def write_archive(record: str, family: str, results: list[dict[str, Any]], root: Path = ARCHIVE_DIR) -> dict[str, str]:
    """Write `<root>/<record>/<family>.jsonl.gz` (atomically, reproducibly); its repository path and sha256."""
    from stages.core.atomic import atomic_path

    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for r in results for line in archive_lines(r))
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as handle:
        handle.write(text.encode())
    path = Path(root) / record / f"{family}.jsonl.gz"
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getvalue())
    return {"path": _relative(path), "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}


def read_archive(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def archive_problems(name: str, record: dict[str, Any], per_question: dict[str, Family],
                     repo: Path = PROJECT_ROOT) -> list[str]:
    """A record's archived predictions against its hash and its per-question counts (a record with no
    `predictions` in its conditions predates them: nothing to check)."""
    problems = []
    for family, entry in record.get("conditions", {}).get("predictions", {}).items():
        path = repo / entry["path"]
        if not path.is_file():
            problems.append(f"{name}: {entry['path']} is missing; commit the predictions with the record")
            continue
        if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
            problems.append(f"{name}: {entry['path']} differs from the sha256 its record names")
            continue
        counts = {(line["run"], line["q"]): line for line in read_archive(path)}
        for rid, run in per_question[family].runs.items():
            for field in (*FIELDS, *OPTIONAL_FIELDS):
                want = getattr(run, field)
                if want is None:
                    continue
                got = [sum(counts[(rid, q)][field]) if (rid, q) in counts else None for q in range(len(want))]
                if got != want.tolist():
                    problems.append(f"{name}: {family}/{rid} {field} counts differ from its archived predictions")
    return problems


def regrade(path: Path) -> list[str]:
    """Grade every archived response again (the format check, the eval stage's content grader) and name the lines
    whose stored verdicts differ."""
    from stages.agent.protocol import check_format
    from stages.eval.content import content_correct

    problems = []
    for line in read_archive(path):
        task_type = "math" if line["ability"] == "math" else "qa"
        formed = [check_format(r).ok for r in line["responses"]]
        content = [content_correct(r, line["answer"], task_type) for r in line["responses"]]
        if formed != line["formed"] or (line["content"][0] is not None and content != line["content"]):
            problems.append(f"{path.name}: {line['run']} question {line['q']} grades differently now")
    return problems


def write_logs(name: str, invocations: list[dict[str, Any]], attempts: list[dict[str, Any]],
               root: Path = LOG_DIR) -> str:
    """`<root>/<name>.jsonl`: the record's invocations, then its attempts, one JSON line each."""
    from stages.core.atomic import write_text

    lines = [{"kind": "invocation", **line} for line in invocations] + [{"kind": "attempt", **a} for a in attempts]
    return _relative(write_text(Path(root) / f"{name}.jsonl", "".join(json.dumps(x) + "\n" for x in lines)))


def _relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(PROJECT_ROOT)) if path.is_relative_to(PROJECT_ROOT) else str(path)


def reload_check(policy: Any) -> dict[str, Any]:
    """{max_abs_diff, ok}: the largest |log p trainer - log p reloaded| over the probe's tokens, and whether it is
    within RELOAD_ATOL. `policy`: the run's CheckpointRef (the trainer's final folder, with probe.json)."""
    import torch

    from stages.generation.models import load_policy
    from stages.rl.probe import max_abs_diff, probe_logprobs, read_probe

    probe = read_probe(Path(policy.path))
    model = load_policy(policy, torch.float32).eval()
    diff = max_abs_diff(probe["logprobs"], probe_logprobs(model, probe["sequences"]))
    return {"max_abs_diff": diff, "ok": diff <= RELOAD_ATOL}


def reload_table(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's table of every RL run's reload check (runs from before the check: "not measured")."""
    rows = []
    for r in results:
        check = r.get("reload_check")
        if r["algorithm"] == "sft":
            continue
        rows.append([run_id(r), "not measured" if check is None else f"{check['max_abs_diff']:.2e}",
                     "" if check is None else "ok" if check["ok"] else
                     f"over {RELOAD_ATOL:g}: the evaluated policy is not the trained one"])
    return {"columns": ["run", "max |log p trainer - log p reloaded| on the probe", "verdict"], "rows": rows}
