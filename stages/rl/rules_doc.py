"""The branch rules' table in docs/rollout.md, generated from BRANCH_RULES (stages/rl/strategies.py), where each
rule's condition is written once beside its code. No stage imports this module, so it is part of no key.
Rewritten and checked with every other generated block: `python -m flows.cli docs --write` (flows/generated_docs.py).
"""

from __future__ import annotations

from stages.core.algorithm_spec import ALGORITHMS
from stages.core.doc_block import read_block, replace_block
from stages.core.env import PROJECT_ROOT
from stages.rl.strategies import BRANCH_RULES, SYMBOLS

DOC = PROJECT_ROOT / "docs" / "rollout.md"
START, END = "<!-- branch-rules:start -->", "<!-- branch-rules:end -->"


def table() -> str:
    """One row per rule: its name, its condition, the algorithms whose line names it; then what the symbols are."""
    rows = ["| branch rule | a candidate makes a copy iff | `rl.algorithm` |", "|---|---|---|"]
    for name in BRANCH_RULES.names():
        users = [a for a in ALGORITHMS.names() if ALGORITHMS.get(a).branches and ALGORITHMS.get(a).branch_rule == name]
        rows.append(f"| `{name}` | `{BRANCH_RULES.get(name).condition}` | {', '.join(f'`{u}`' for u in users)} |")
    legend = ", ".join(f"{symbol} = `{setting}`" for symbol, setting in SYMBOLS.items())
    return "\n".join(rows) + (f"\n\n{legend} (under `rl.rollout`);\nu ~ U[0, 1) is the draw, dH the entropy change, "
                              "c the penalty counter.")


def documented() -> str:
    return read_block(DOC, START, END)


def render(text: str) -> str:
    """docs/rollout.md's `text` with the table rewritten."""
    return replace_block(text, START, END, table(), str(DOC))
