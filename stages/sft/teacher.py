"""Teacher trajectories for cold-start SFT, built from the generated train tasks with the real tools.

A math task runs its reference solution in the python sandbox; a qa task issues each hop's query to the
search tool over the generated corpus. The real tool output goes into the text through
`stages.agent.protocol.render_result`, exactly as RL and evaluation insert it, between `<think>` sections,
ending in `<answer> The final answer is \\[ \\boxed{X} \\] </answer>`. A trajectory whose tool output does not
support the gold answer (python printed something else; search missed the hop's document) is left out and
counted, never patched. Only the `train` split is read.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.agent.prompts import build_messages
from stages.agent.protocol import ToolCall, check_format, render_result
from stages.core.atomic import read_jsonl
from stages.core.log import get_logger
from stages.core.reporter import track

log = get_logger(__name__)

RunTool = Callable[[ToolCall], str]  # one tool call -> the result text the environment inserts

_MATH_PLANS = (
    "This needs exact arithmetic on large numbers, so I will compute it with python instead of by hand.",
    "Doing this in my head is error-prone. I will write a short python program and read its output.",
    "I should not guess here. Let me calculate it exactly with the python interpreter.",
)
_MATH_CLOSE = (
    "The program printed {value}, so the answer is {value}.",
    "The python result is {value}. That is the exact value asked for.",
    "The interpreter returned {value}, which answers the question.",
)
_QA_PLANS = (
    "I do not know these facts, so I will look them up step by step. First I search for {query}.",
    "This question needs two facts. I will search for {query} first.",
    "Let me find the information with the search tool, starting with {query}.",
)
_QA_NEXT = (
    "According to the result, {title}: {fact}. Next I search for {query}.",
    "The result says {title}: {fact}. Now I need to search for {query}.",
)
_QA_CLOSE = (
    "According to the result, {title}: {fact}. So the answer is {answer}.",
    "The result says {title}: {fact}. Therefore the answer is {answer}.",
)


@dataclass
class TeacherReport:
    rows: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # "<task id>: <why>"
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {"rows": len(self.rows), "dropped": len(self.dropped), **{f"rows_{k}": v for k, v in
                                                                          self.by_kind.items()}}


class UnsupportedTrajectory(ValueError):
    """The real tool output does not back the gold answer; the task is left out."""


def _answer(value: str) -> str:
    return f"<answer> The final answer is \\[ \\boxed{{{value}}} \\] </answer>"


def math_trajectory(task: dict[str, Any], run_tool: RunTool, rng: random.Random) -> str:
    code = task.get("solution_code") or ""
    if not code.strip():
        raise UnsupportedTrajectory("math task has no solution_code")
    raw = run_tool(ToolCall("python", code))  # inserted as is, exactly as RL inserts the tool's text
    output = raw.strip()
    if output != str(task["answer"]).strip():
        raise UnsupportedTrajectory(f"python printed {output[:60]!r}, gold answer is {task['answer']!r}")
    return (f"<think> {rng.choice(_MATH_PLANS)} </think>\n<python>\n{code}\n</python>{render_result(raw)}\n"
            f"<think> {rng.choice(_MATH_CLOSE).format(value=output)} </think>\n{_answer(output)}")


def _squash(text: str) -> str:
    return " ".join(text.split())


def retrieved(doc: tuple[str, str], result: str) -> bool:
    """The search result holds the document itself (its title and the start of its text), not a mention."""
    title, body = doc
    return title in result and _squash(body[:80]) in _squash(result)


def qa_trajectory(task: dict[str, Any], run_tool: RunTool, rng: random.Random,
                  docs: dict[str, tuple[str, str]]) -> str:
    hops = task.get("hops") or []
    if not hops:
        raise UnsupportedTrajectory("qa task has no hops")
    answer = str(task["answer"])
    parts = [f"<think> {rng.choice(_QA_PLANS).format(query=hops[0]['query'])} </think>\n"]
    for i, hop in enumerate(hops):
        result = run_tool(ToolCall("search", hop["query"]))
        doc = docs.get(hop["doc_id"])
        if doc is None or not retrieved(doc, result):
            raise UnsupportedTrajectory(f"search for {hop['query']!r} did not return document {hop['doc_id']}")
        title = doc[0]
        parts.append(f"<search> {hop['query']} </search>{render_result(result)}\n")
        if i + 1 < len(hops):
            text = rng.choice(_QA_NEXT).format(title=title, fact=hop["fact"], query=hops[i + 1]["query"])
        else:
            if answer not in result:
                raise UnsupportedTrajectory(f"the last search result does not contain the answer {answer!r}")
            text = rng.choice(_QA_CLOSE).format(title=title, fact=hop["fact"], answer=answer)
        parts.append(f"<think> {text} </think>\n")
    return "".join(parts) + _answer(answer)


def split_doc(contents: str) -> tuple[str, str]:
    """A FlashRAG `contents` -> (title, text): the title is the first line."""
    title, _, body = str(contents).partition("\n")
    return title, body


def corpus_docs(corpus_path: str | Path) -> dict[str, tuple[str, str]]:
    """doc id -> (title, text) of the search corpus."""
    return {row["id"]: split_doc(row["contents"]) for row in read_jsonl(corpus_path)}


def train_tasks(tasks_path: str | Path) -> list[dict[str, Any]]:
    """The train split of the generated task set; each row is checked for the fields the teacher needs."""
    rows = []
    for i, task in enumerate(read_jsonl(tasks_path)):
        missing = [k for k in ("id", "kind", "question", "answer", "split") if k not in task]
        if missing or task["kind"] not in ("math", "qa"):
            raise ValueError(f"{tasks_path} row {i}: expected id/kind(math|qa)/question/answer/split, "
                             f"missing {missing} or kind={task.get('kind')!r}; regenerate it with the data stage")
        if task["split"] == "train":
            rows.append(task)
    return rows


def build_trajectories(tasks: Iterable[dict[str, Any]], run_tool: RunTool, docs: dict[str, tuple[str, str]],
                       template: str, limit: int, seed: int = 0) -> TeacherReport:
    """Up to `limit` SFT rows (canonical sharegpt) from tasks, in order; unsupported tasks are reported."""
    rng = random.Random(seed)
    report = TeacherReport()
    tasks = list(tasks)
    with track("sft-teacher", "teacher trajectories", total=min(limit, len(tasks)), unit="trajectories") as bar:
        for task in tasks:
            if len(report.rows) >= limit:
                break
            try:
                if task["kind"] == "math":
                    text = math_trajectory(task, run_tool, rng)
                else:
                    text = qa_trajectory(task, run_tool, rng, docs)
            except UnsupportedTrajectory as err:
                report.dropped.append(f"{task['id']}: {err}")
                continue
            verdict = check_format(text)
            if not verdict.ok:  # a bug in the templates above, not in the data
                raise AssertionError(f"teacher trajectory for {task['id']} breaks the format: {verdict.reason}")
            system, user = build_messages(task["question"], template)
            report.rows.append({"conversations": [{"from": "human", "value": user["content"]},
                                                  {"from": "gpt", "value": text}],
                                "system": system["content"], "id": task["id"], "answer": str(task["answer"])})
            report.by_kind[task["kind"]] = report.by_kind.get(task["kind"], 0) + 1
            bar.advance()
    if report.dropped:
        log.warning("teacher: left out %d tasks whose tool output did not support the answer, e.g. %s",
                    len(report.dropped), report.dropped[0])
    return report


def toolbox_runner(agent_cfg: Any, corpus_path: str | Path, cache_root: str | Path) -> tuple[RunTool, Callable]:
    """A RunTool over the real tools (stages.agent.toolbox.ToolBox), plus its close function."""
    from stages.agent.toolbox import ToolBox

    box = ToolBox.from_config(agent_cfg, corpus_path, cache_root)

    def run(call: ToolCall) -> str:
        result = box.execute(call, box.new_state())
        if not result.ok:
            raise UnsupportedTrajectory(f"{call.tool} tool failed: {result.text[:200]}")
        return result.text

    return run, getattr(box, "close", lambda: None)
