"""Teacher trajectories for cold-start SFT, built from the generated train tasks with the real tools.

The teacher is a scripted model in the agent runtime's text loop (stages.agent.loop), the loop evaluation runs:
it writes each segment, the loop parses the call its closing tag ends, runs it through the ToolBox and appends
the result with `render_result`, exactly as RL and evaluation do; the next segment reads that result. A math
task runs its reference solution in the python sandbox; a qa task issues each hop's query to the search tool
over the generated corpus. Segments are `<think>` sections and calls, ending in
`<answer> The final answer is \\[ \\boxed{X} \\] </answer>`. A trajectory whose tool output does not support
the gold answer (python printed something else; search missed the hop's document) is left out and counted,
never patched. Only the `train` split is read.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.agent.loop import LoopRules, TextBudget, TextLoopState, TextSegment, run_text_loop
from stages.agent.prompt_templates import build_messages
from stages.agent.protocol import STOP_TAGS, ToolCall, check_format
from stages.core.atomic import read_jsonl
from stages.core.config.agent import AgentSection, ToolLimitsSection
from stages.core.log import get_logger
from stages.core.reporter import track

log = get_logger(__name__)

RunTool = Callable[[ToolCall], str]  # one tool call -> the result text the environment inserts (tests, benches)
Step = Callable[[Any], str]          # the last ToolResult (None at the start) -> the teacher's next segment

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


@dataclass(frozen=True)
class _FunctionResult:
    tool: str
    text: str
    ok: bool = True
    latency_s: float = 0.0
    meta: dict = field(default_factory=dict)


class FunctionTools:
    """A RunTool function as the loop's toolbox (tests and benches; the stage uses the real ToolBox)."""

    def __init__(self, run_tool: RunTool) -> None:
        self.run_tool = run_tool

    def new_state(self) -> None:
        return None

    async def aexecute(self, call: ToolCall, state: None) -> _FunctionResult:
        start = time.monotonic()
        return _FunctionResult(call.tool, self.run_tool(call), latency_s=time.monotonic() - start)


def play(steps: Sequence[Step], tools: Any) -> str:
    """Run the teacher's segments through the text loop; the full trajectory text."""
    state = TextLoopState()

    async def generate(output: str, max_tokens: int, call: int) -> TextSegment:
        last = state.results[-1] if state.results else None
        if last is not None and not last.ok:
            raise UnsupportedTrajectory(f"{last.tool} tool failed: {last.text[:200]}")
        text = steps[call](last)
        stop = next((tag for tag in STOP_TAGS if text.endswith(tag)), None)
        return TextSegment(text, "stop" if stop else "eos", stop, 0)

    tools = tools if hasattr(tools, "aexecute") else FunctionTools(tools)
    budget = TextBudget(max_tokens=1, max_total_tokens=1, max_calls=len(steps))  # the script costs no tokens
    asyncio.run(run_text_loop(generate, tools, LoopRules(), budget, state))
    if state.finish_reason != "stop":  # a bug in the segments below, not in the data
        raise AssertionError(f"the teacher's script ended with {state.finish_reason!r}")
    return state.output


def math_trajectory(task: dict[str, Any], tools: Any, rng: random.Random) -> str:
    code = task.get("solution_code") or ""
    if not code.strip():
        raise UnsupportedTrajectory("math task has no solution_code")
    before = rng.getstate()  # a dropped task consumes no wording choice: the other tasks' text stays the same
    plan = rng.choice(_MATH_PLANS)

    def close(result: Any) -> str:
        output = result.text.strip()  # inserted as is by the loop, exactly as RL inserts the tool's text
        if output != str(task["answer"]).strip():
            rng.setstate(before)
            raise UnsupportedTrajectory(f"python printed {output[:60]!r}, gold answer is {task['answer']!r}")
        return f"\n<think> {rng.choice(_MATH_CLOSE).format(value=output)} </think>\n{_answer(output)}"

    return play([lambda _: f"<think> {plan} </think>\n<python>\n{code}\n</python>", close], tools)


def _squash(text: str) -> str:
    return " ".join(text.split())


def retrieved(doc: tuple[str, str], result: str) -> bool:
    """The search result holds the document itself (its title and the start of its text), not a mention."""
    title, body = doc
    return title in result and _squash(body[:80]) in _squash(result)


def qa_trajectory(task: dict[str, Any], tools: Any, rng: random.Random,
                  docs: dict[str, tuple[str, str]]) -> str:
    hops = task.get("hops") or []
    if not hops:
        raise UnsupportedTrajectory("qa task has no hops")
    answer = str(task["answer"])

    def after(i: int) -> Step:
        """The segment after hop i's result: check it, then the next search or the answer."""
        def step(result: Any) -> str:
            hop, doc = hops[i], docs.get(hops[i]["doc_id"])
            if doc is None or not retrieved(doc, result.text):
                raise UnsupportedTrajectory(f"search for {hop['query']!r} did not return document {hop['doc_id']}")
            if i + 1 < len(hops):
                text = rng.choice(_QA_NEXT).format(title=doc[0], fact=hop["fact"], query=hops[i + 1]["query"])
                return f"\n<think> {text} </think>\n<search> {hops[i + 1]['query']} </search>"
            if answer not in result.text:
                raise UnsupportedTrajectory(f"the last search result does not contain the answer {answer!r}")
            text = rng.choice(_QA_CLOSE).format(title=doc[0], fact=hop["fact"], answer=answer)
            return f"\n<think> {text} </think>\n{_answer(answer)}"
        return step

    plan = rng.choice(_QA_PLANS).format(query=hops[0]["query"])
    first = f"<think> {plan} </think>\n<search> {hops[0]['query']} </search>"
    return play([lambda _: first, *(after(i) for i in range(len(hops)))], tools)


_CHAIN_PLANS = ("I need the year. I search for {query}.", "The year is not known to me. Let me search {query}.")
_CHAIN_COMPUTE = ("{title} was {fact}. Python computes the difference.", "The result says {fact}. I subtract with python.")
_CHAIN_CLOSE = ("Python printed {value}.", "The difference is {value}.")


def chain_trajectory(task: dict[str, Any], tools: Any, rng: random.Random,
                     docs: dict[str, tuple[str, str]]) -> str:
    """A lookup and a computation on its result: search the hop's query, read the year from the document it
    returns, run the reference code on it (two dependent calls), answer with what python printed."""
    hops, code = task.get("hops") or [], task.get("solution_code") or ""
    if len(hops) != 1 or not code.strip():
        raise UnsupportedTrajectory("chain task needs one hop and a solution_code")
    hop, answer = hops[0], str(task["answer"])
    before = rng.getstate()

    def compute(result: Any) -> str:
        doc = docs.get(hop["doc_id"])
        if doc is None or not retrieved(doc, result.text) or hop["fact"] not in result.text:
            rng.setstate(before)
            raise UnsupportedTrajectory(f"search for {hop['query']!r} did not return document {hop['doc_id']}")
        text = rng.choice(_CHAIN_COMPUTE).format(title=doc[0], fact=hop["fact"])
        return f"\n<think> {text} </think>\n<python>\n{code}\n</python>"

    def close(result: Any) -> str:
        output = result.text.strip()
        if output != answer:
            rng.setstate(before)
            raise UnsupportedTrajectory(f"python printed {output[:60]!r}, gold answer is {answer!r}")
        return f"\n<think> {rng.choice(_CHAIN_CLOSE).format(value=output)} </think>\n{_answer(output)}"

    first = f"<think> {rng.choice(_CHAIN_PLANS).format(query=hop['query'])} </think>\n<search> {hop['query']} </search>"
    return play([lambda _: first, compute, close], tools)


# task kind -> its teacher: (task, tools, rng, corpus docs) -> trajectory text
TRAJECTORIES: dict[str, Callable[..., str]] = {
    "math": lambda task, tools, rng, docs: math_trajectory(task, tools, rng),
    "qa": qa_trajectory,
    "chain": chain_trajectory,
}


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
        if missing or task["kind"] not in TRAJECTORIES:
            raise ValueError(f"{tasks_path} row {i}: expected id/kind({'|'.join(TRAJECTORIES)})/question/answer/split, "
                             f"missing {missing} or kind={task.get('kind')!r}; regenerate it with the data stage")
        if task["split"] == "train":
            rows.append(task)
    return rows


def build_trajectories(tasks: Iterable[dict[str, Any]], tools: Any, docs: dict[str, tuple[str, str]],
                       template: str, limit: int, seed: int = 0) -> TeacherReport:
    """Up to `limit` SFT rows (canonical sharegpt) from tasks, in order; unsupported tasks are reported. `tools`
    is a ToolBox (or a RunTool function)."""
    rng = random.Random(seed)
    report = TeacherReport()
    tasks = list(tasks)
    with track("sft-teacher", "teacher trajectories", total=min(limit, len(tasks)), unit="trajectories") as bar:
        for task in tasks:
            if len(report.rows) >= limit:
                break
            try:
                text = TRAJECTORIES[task["kind"]](task, tools, rng, docs)
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


def teacher_toolbox(agent_cfg: AgentSection, corpus_path: str | Path, cache_root: str | Path) -> Any:
    """The real tools the teacher calls. The agent's call limits are for the model: the teacher writes its own
    calls, so they do not apply (and changing them keeps the SFT data, and its cache, the same)."""
    from stages.agent.toolbox import ToolBox

    unlimited = ToolLimitsSection(max_calls=1_000_000, reject_repeated_queries=False)
    return ToolBox.from_config(agent_cfg.model_copy(update={"limits": unlimited}), str(corpus_path), str(cache_root))
