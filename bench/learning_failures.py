"""How the held-out answers of a learning-bench variant fail: format errors by cause, answers cut at the response cap,
and tool calls per answer, for the SFT policy and every RL run of one results folder.

    .venv/bin/python bench/learning_failures.py bench/results/learning/results/chain@lr1e-5

The reward gives -1 to a malformed or truncated answer and 0 to a well-formed wrong one (stages/agent/rewards.py, as
the reference does), so a policy that learns to call one more tool and runs into the cap loses more than one that
answers wrong: this table is where that shows. It reads the held-out predictions each run's result points at.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

CAUSES = ("cut at cap", "no <answer>", "answer without boxed", "answer not closed", "other")


def failure_cause(response: str, length: int, cap: int) -> str:
    """The first reason, in CAUSES order, that a malformed answer is malformed."""
    if length >= cap:
        return "cut at cap"
    if "<answer>" not in response:
        return "no <answer>"
    if "\\boxed" not in response.split("<answer>")[-1]:
        return "answer without boxed"
    if "</answer>" not in response:
        return "answer not closed"
    return "other"


def breakdown(result_file: Path) -> dict[str, object]:
    """One run's shares: format errors, each cause, answers cut at the cap, and answers by tool calls (0-3+)."""
    result = json.loads(result_file.read_text())
    cap = result["config"]["rl"]["rollout"]["max_response_length"]  # the SFT result holds its family's too
    rows = [json.loads(line) for line in
            Path(result["heldout_path"]).with_name("predictions.jsonl").read_text().splitlines()]
    answers = [(resp, length, ok, calls) for row in rows for resp, length, ok, calls in
               zip(row["responses"], row["length"], row["format_ok"], row["tool_calls"])]
    causes = Counter(failure_cause(resp, length, cap) for resp, length, ok, _ in answers if not ok)
    calls = Counter(min(c, 3) for *_, c in answers)
    n = len(answers)
    return {"answers": n, "format errors": sum(causes.values()) / n,
            **{cause: causes[cause] / n for cause in CAUSES},
            "cut (any)": sum(length >= cap for _, length, _, _ in answers) / n,
            **{f"{k}{'+' if k == 3 else ''} calls": calls[k] / n for k in range(4)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="results/<family>[@<tag>] of a learning-bench root")
    args = parser.parse_args()
    runs = sorted(args.folder.glob("*-s*.json"))
    shared = args.folder.parent / args.folder.name.split("@")[0] / "sft.json"
    if not runs:
        raise SystemExit(f"no run results (<algo>-s<seed>.json) in {args.folder}")
    table = [("SFT", breakdown(shared))] if shared.is_file() else []
    table += [(path.stem, breakdown(path)) for path in runs]
    columns = list(table[0][1])[1:]
    print("| policy | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for name, shares in table:
        print(f"| {name} | " + " | ".join(f"{shares[c]:.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
