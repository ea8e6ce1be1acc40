"""The learning bench's per-question counts, committed beside its record (`bench/results/per-question/<record>.json`)
so that every interval and headline figure of the record can be recomputed from the repository (issue 44).

One file per learning record; per task family its split, its questions (count and the sha256 of their texts), and
per run one line: who it is (policy, algorithm, seed, evaluation seed, lr, steps, samples per question) and
strings of one base-36 character per question: correct answers, well-formed answers and tool calls, each summed
over the run's samples of that question, and (protocol v2, docs/learning.md) `content`: the answers right wherever
the response gives one.

    {"record": "learning", "families": {"arith": {"split": "eval_test", "questions": 400,
      "questions_sha256": "...", "runs": {
      "grpo-s0": {"policy": "grpo", "algorithm": "grpo", "seed": 0, "eval_seed": 0, "lr": 3e-06, "steps": 6,
                  "samples": 1, "correct": "0100...", "formed": "1101...", "calls": "1102..."}}}}}
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.env import PROJECT_ROOT

PER_QUESTION_DIR = PROJECT_ROOT / "bench" / "results" / "per-question"
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
SFT = "sft"
HEADLINE_DIGITS = 4  # a record's headline figures are rounded to at least this many decimals
FIELDS = ("correct", "formed", "calls")
OPTIONAL_FIELDS = ("content",)  # content accuracy (protocol v2): a record from before it has none


@dataclass(frozen=True)
class Run:
    """One evaluated policy: counts per question over `samples` samples (correct, well-formed, tool calls)."""
    policy: str
    algorithm: str | None
    seed: int
    eval_seed: int
    lr: float
    steps: int
    samples: int
    correct: np.ndarray
    formed: np.ndarray
    calls: np.ndarray
    content: np.ndarray | None = None  # answers right wherever given (stages/eval/content.py), per question


@dataclass(frozen=True)
class Family:
    split: str
    questions: int
    questions_sha256: str
    runs: dict[str, Run]


# ---- encoding -----------------------------------------------------------------------------------------------
def encode(counts: list[int], what: str = "counts") -> str:
    """One base-36 character per question (0..35)."""
    bad = [c for c in counts if not 0 <= int(c) < len(DIGITS)]
    if bad:
        raise ValueError(f"{what}: {bad[:3]} outside 0..35, which one base-36 character per question holds; "
                         "lower the samples per question")
    return "".join(DIGITS[int(c)] for c in counts)


def decode(text: str) -> np.ndarray:
    return np.array([int(ch, 36) for ch in text], dtype=int)


def questions_sha256(questions: list[str]) -> str:
    """sha256 of the question texts as a compact JSON list (the texts themselves stay in the data, not here)."""
    return hashlib.sha256(json.dumps(questions, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


# ---- from the workers' results files ------------------------------------------------------------------------
def run_id(result: dict[str, Any]) -> str:
    """`<policy>-s<seed>`, or the result's own `run_id` (runs of one policy and seed at several settings)."""
    return result.get("run_id") or f"{result['algorithm']}-s{result['seed']}"


def compact_run(result: dict[str, Any]) -> dict[str, Any]:
    """One run's line from a worker's results file (`algorithm` "sft", an arm such as "control" or "format", or the
    RL algorithm; the counts `correct_count_Q`, `formed_count_Q`, `calls_Q`, and `content_count_Q` where it has
    one; `samples`, `seed`, `eval_seed`; lr and steps from its config, or a top-level `lr` where the config cannot
    hold it). The SFT policy had no RL: lr 0, steps 0."""
    policy, rl = result["algorithm"], result.get("config", {}).get("rl", {})
    sft = policy == SFT
    n = len(result["correct_count_Q"])
    if any(len(result[key]) != n for key in ("formed_count_Q", "calls_Q", "content_count_Q") if key in result):
        raise ValueError(f"{run_id(result)}: correct_count_Q, formed_count_Q and calls_Q differ in length")
    return {"policy": policy, "algorithm": None if sft else rl.get("algorithm"), "seed": int(result["seed"]),
            "eval_seed": int(result["eval_seed"]),
            "lr": 0.0 if sft else float(result.get("lr", rl.get("optim", {}).get("lr"))),
            "steps": 0 if sft else int(rl["trainer"]["total_steps"]), "samples": int(result["samples"]),
            "correct": encode(result["correct_count_Q"], f"{run_id(result)} correct"),
            "formed": encode(result["formed_count_Q"], f"{run_id(result)} formed"),
            "calls": encode(result["calls_Q"], f"{run_id(result)} calls"),
            **({"content": encode(result["content_count_Q"], f"{run_id(result)} content")}
               if "content_count_Q" in result else {})}


def family_payload(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A family's entry from its runs' results files: all evaluated on the same split and questions."""
    first = results[0]
    runs: dict[str, Any] = {}
    for r in results:
        if r["split"] != first["split"] or r["questions"] != first["questions"]:
            raise ValueError(f"{run_id(r)} was evaluated on other questions than {run_id(first)} "
                             f"({r['split']} vs {first['split']}); rerun its evaluation")
        if run_id(r) in runs:
            raise ValueError(f"two runs are {run_id(r)}: give them distinct `run_id`s in their results files")
        runs[run_id(r)] = compact_run(r)
    return {"split": first["split"], "questions": len(first["questions"]),
            "questions_sha256": questions_sha256(first["questions"]), "runs": runs}


def dumps(record: str, families: dict[str, Any]) -> str:
    """The file's text: valid JSON with one run per line."""
    lines = ["{" + f'"record": {json.dumps(record)}, "families": ' + "{"]
    for i, (family, payload) in enumerate(families.items()):
        head = {k: v for k, v in payload.items() if k != "runs"}
        lines.append(f"{json.dumps(family)}: {json.dumps(head)[:-1]}, " + '"runs": {')
        runs = list(payload["runs"].items())
        lines += [f" {json.dumps(rid)}: {json.dumps(run)}" + ("," if j < len(runs) - 1 else "")
                  for j, (rid, run) in enumerate(runs)]
        lines.append("}}" + ("," if i < len(families) - 1 else ""))
    return "\n".join(lines) + "\n}}\n"


def write_per_question(name: str, family_payloads: dict[str, Any], root: Path = PER_QUESTION_DIR,
                       keep_others: bool = True) -> Path:
    """Write `<root>/<name>.json` atomically; with `keep_others`, families the file holds and `family_payloads`
    does not are kept (a bench run over one family keeps the other's runs)."""
    from stages.core.atomic import write_text

    path = Path(root) / f"{name}.json"
    families = json.loads(path.read_text())["families"] if keep_others and path.is_file() else {}
    families.update(family_payloads)
    text = dumps(name, families)
    json.loads(text)  # the hand-written layout is JSON, or nothing is written
    return write_text(path, text)


# ---- reading back -------------------------------------------------------------------------------------------
def read_per_question(name: str, root: Path = PER_QUESTION_DIR) -> dict[str, Family]:
    """Per family its split, questions and runs, the counts as int arrays (checked against the question count)."""
    path = Path(root) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no per-question file {path}: the learning bench writes it with its record")
    out = {}
    for family, payload in json.loads(path.read_text())["families"].items():
        runs = {}
        for rid, run in payload["runs"].items():
            arrays = {key: decode(run[key]) for key in (*FIELDS, *OPTIONAL_FIELDS) if key in run}
            if any(a.size != payload["questions"] for a in arrays.values()):
                raise ValueError(f"{path}: {family}/{rid} has counts for other than {payload['questions']} questions")
            runs[rid] = Run(**{k: v for k, v in run.items() if k not in arrays}, **arrays)
        out[family] = Family(payload["split"], payload["questions"], payload["questions_sha256"], runs)
    return out


def policies(family: Family) -> list[str]:
    """The family's policies in the order of its runs."""
    return list(dict.fromkeys(run.policy for run in family.runs.values()))


def runs_of(family: Family, policy: str) -> dict[int, Run]:
    """A policy's runs by seed."""
    out: dict[int, Run] = {}
    for rid, run in family.runs.items():
        if run.policy == policy:
            if run.seed in out:
                raise ValueError(f"{policy} has two runs with seed {run.seed} ({rid}): one per seed is compared")
            out[run.seed] = run
    return dict(sorted(out.items()))


def rate_SQ(runs: list[Run], field: str = "correct") -> np.ndarray:
    """[seeds, questions] counts / samples (accuracy, well-formed rate, tool calls per sample)."""
    return np.array([getattr(r, field) / r.samples for r in runs], dtype=float)


def count_SQ(runs: list[Run], field: str) -> np.ndarray:
    return np.array([getattr(r, field) for r in runs], dtype=float)


def paired(family: Family, a: str, b: str) -> tuple[list[int], list[Run], list[Run]]:
    """Runs of `a` and `b` paired by seed (their shared evaluation seed), over the seeds both have."""
    ra, rb = runs_of(family, a), runs_of(family, b)
    seeds = [s for s in ra if s in rb]
    return seeds, [ra[s] for s in seeds], [rb[s] for s in seeds]


def headline_figures(per_question: dict[str, Family], digits: int = HEADLINE_DIGITS) -> dict[str, float]:
    """A record's headline figures: per family `<family>_<policy>`, the policy's accuracy (mean over its seeds and
    the questions), and `<family>_<policy>_gain`, its mean paired difference with the SFT policy."""
    figures: dict[str, float] = {}
    for name, family in per_question.items():
        for policy in policies(family):
            figures[f"{name}_{policy}"] = round(float(rate_SQ(list(runs_of(family, policy).values())).mean()), digits)
            if policy != SFT and runs_of(family, SFT):
                _, rl, sft = paired(family, policy, SFT)
                if rl:
                    figures[f"{name}_{policy}_gain"] = round(float((rate_SQ(rl) - rate_SQ(sft)).mean()), digits)
    return figures


# ---- provenance ---------------------------------------------------------------------------------------------
def provenance_problems(record_path: Path, per_question_root: Path = PER_QUESTION_DIR,
                        repo: Path = PROJECT_ROOT) -> list[str]:
    """What makes a learning record unverifiable: a commit git does not know, uncommitted changes, no per-question
    file, headline figures the per-question file does not reproduce (to HEADLINE_DIGITS decimals), or archived
    predictions that are missing, altered or do not sum to its counts (bench/learning_archive.py)."""
    record_path = Path(record_path)
    record, name = json.loads(record_path.read_text()), record_path.stem
    problems = []
    commit = record.get("commit")
    known = bool(commit) and subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo,
                                            capture_output=True).returncode == 0
    if not known:
        problems.append(f"{name}: commit {commit!r} is unknown to git; record it from a committed checkout")
    if record.get("uncommitted_changes") is not False:
        problems.append(f"{name}: recorded with uncommitted changes ({record.get('uncommitted_changes')!r}); "
                        "commit, then rerun the bench's report")
    try:
        per_question = read_per_question(name, per_question_root)
    except (FileNotFoundError, ValueError, KeyError) as err:
        return [*problems, f"{name}: {err}"]
    from bench.learning_archive import archive_problems

    problems += archive_problems(name, record, per_question, repo)
    stored, tolerance = record.get("figures", {}), 0.5 * 10**-HEADLINE_DIGITS + 1e-12
    for key, value in headline_figures(per_question).items():
        if key not in stored:
            problems.append(f"{name}: figure {key} ({value}) is in the per-question file but not in the record")
        elif not isinstance(stored[key], (int, float)) or abs(stored[key] - value) > tolerance:
            problems.append(f"{name}: figure {key} is {stored[key]!r} in the record, {value} from the per-question "
                            "file")
    return problems
