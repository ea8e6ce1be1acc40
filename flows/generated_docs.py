"""Every generated block of the docs and prefect.yaml, listed once, and the one command that rewrites or checks them
all (`arpo docs --write|--check`, or `python -m flows.cli docs ...` from a checkout). CI runs the check beside ruff
(scripts/test.sh); docs/decisions.md's list of generators is itself generated from `GENERATED`.

Each line names a file, what is generated in it, from what, and its renderer: a function of the file's text that
returns the text with its generated blocks rewritten (the rest of the file is kept as written). A generator that
also checks a rule of what it renders (a config field without a description, a key covering another stage's code)
reports it as a problem, which fails the check as a stale block does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stages.core.doc_block import DOCS_COMMAND, replace_block
from stages.core.env import PROJECT_ROOT


@dataclass(frozen=True, kw_only=True)
class GeneratedDoc:
    """path: the file (relative to the project root). blocks: what is generated there. source: what it is generated
    from. render: the file's text -> the text with its blocks rewritten. problems: the rule violations the generator
    finds (each fails the check)."""

    path: str
    blocks: str
    source: str
    render: Callable[[str], str]
    problems: Callable[[], list[str]] = field(default=list)


def _deployments(text: str) -> str:
    from flows.deployments import render

    return render(text)


def _key_coverage(text: str) -> str:
    from stages.core.key_coverage import render

    return render(text)


def _key_problems() -> list[str]:
    from stages.core.key_coverage import all_problems

    return all_problems()


def _branch_rules(text: str) -> str:
    from stages.rl.rules_doc import render

    return render(text)


def _config_reference(text: str) -> str:
    from stages.core.config.config_doc import render

    return render()  # the whole page


def _undescribed() -> list[str]:
    from stages.core.config.config_doc import undocumented

    return [f"{key} has no description; give its Field(...) one" for key in undocumented()]


def _benchmark_tables(text: str) -> str:
    from stages.eval.benchmark_table import render

    return render(text)


def _bench_results(text: str) -> str:
    from bench.results import load_results, render

    return render(text, load_results())


START, END = "<!-- generated-docs:start -->", "<!-- generated-docs:end -->"


def _generators_list(text: str) -> str:
    rows = ["| file | what is generated there | from |", "|---|---|---|"]
    rows += [f"| `{doc.path}` | {doc.blocks} | {doc.source} |" for doc in GENERATED]
    return replace_block(text, START, END, "\n".join(rows), "docs/decisions.md")


GENERATED: tuple[GeneratedDoc, ...] = (
    GeneratedDoc(path="prefect.yaml", blocks="the `stage-<name>` deployments; the work pools' job variables",
                 source="the stage table (`stages/core/stage_spec.py`); `prefect.toml`'s heartbeat "
                        "(`flows.deployments`)", render=_deployments),
    GeneratedDoc(path="docs/config.md", blocks="the whole page: every config key",
                 source="the config models (`stages.core.config.config_doc`)", render=_config_reference,
                 problems=_undescribed),
    GeneratedDoc(path="docs/caching.md", blocks="what each stage key covers",
                 source="the key modules' imports (`stages.core.key_coverage`)", render=_key_coverage,
                 problems=_key_problems),
    GeneratedDoc(path="docs/rollout.md", blocks="the branch rules' table",
                 source="`BRANCH_RULES`, `stages/rl/strategies.py` (`stages.rl.rules_doc`)", render=_branch_rules),
    GeneratedDoc(path="docs/eval.md", blocks="the benchmark and gold-parser tables",
                 source="the registries of `stages/eval/benchmarks.py` (`stages.eval.benchmark_table`)",
                 render=_benchmark_tables),
    GeneratedDoc(path="docs/benchmarks.md", blocks="the measured figures' tables",
                 source="`bench/results/*.json` (`bench.results`)", render=_bench_results),
    GeneratedDoc(path="docs/decisions.md", blocks="this list of generated blocks",
                 source="`GENERATED`, `flows/generated_docs.py`", render=_generators_list),
)


def stale(root: Path = PROJECT_ROOT) -> list[tuple[GeneratedDoc, str]]:
    """The generated files whose text differs from what their generator renders, with the rendered text."""
    out = []
    for doc in GENERATED:
        text = (root / doc.path).read_text(encoding="utf-8")
        want = doc.render(text)
        if want != text:
            out.append((doc, want))
    return out


def run(write: bool, root: Path = PROJECT_ROOT) -> int:
    """Rewrite (`write`) or check every generated block; 1 when a block was stale (check) or a generator found a
    problem, else 0."""
    from stages.core.atomic import write_text

    problems = [problem for doc in GENERATED for problem in doc.problems()]
    for problem in problems:
        print(f"problem: {problem}")
    changed = stale(root)
    for doc, want in changed:
        if write:
            write_text(root / doc.path, want)
            print(f"{doc.path}: rewritten ({doc.blocks})")
        else:
            print(f"{doc.path} is out of date ({doc.blocks}): run `{DOCS_COMMAND}`")
    if not changed:
        print(f"{len(GENERATED)} generated files up to date")
    return 1 if problems or (changed and not write) else 0


def register(sub: argparse._SubParsersAction) -> None:
    docs = sub.add_parser("docs", help="rewrite (--write) or check (--check) every generated block of the docs and "
                                       "prefect.yaml (flows/generated_docs.py)")
    mode = docs.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the stale blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block is stale (CI runs this)")
    docs.set_defaults(handler=lambda args: run(write=args.write))
