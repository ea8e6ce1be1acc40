"""The TIR step loop (stages/agent/loop.py): one rule table for the token driver (RL, SFT sampling) and the text
driver (evaluation, the SFT teacher), and the drivers that share it."""

from __future__ import annotations

import ast
import asyncio
import functools
from pathlib import Path

import pytest

from stages.agent.loop import LoopRules, Segment, Step, TextBudget, TextLoopState, TextSegment, next_step, run_text_loop
from stages.agent.protocol import ANSWER_STOP, ToolCall
from stages.core.env import PROJECT_ROOT
from stages.generation.prompt_items import PromptItem
from stages.generation.tool_rollout import ToolRollout
from stages.rl.rollout import TreeRollout
from tests.unit.test_rl_rollout import SEARCH, cfg, search_then_answer
from tests.unit.test_rl_rollout_fakes import ScriptedBackend, ToyTokenizer, ToyToolBox

RL = LoopRules(call_limit=1, empty_call="end")
EVAL = LoopRules(stops=("</search>", "</python>", ANSWER_STOP), call_limit=None, empty_call="ask")


@pytest.mark.parametrize(("rules", "segment", "calls", "expected"), [
    (RL, Segment("done", "eos"), 0, Step("done", "eos")),
    (EVAL, Segment("<answer>4</answer>", "stop", ANSWER_STOP, 10, tokens=5), 0,
     Step("done", "answer", ended_by_environment=True)),
    # a call cut by a per-request cap: budget left and tokens written -> keep going; no budget -> length
    (EVAL, Segment("<python>pri", "length", None, 10, tokens=4), 0, Step("continue")),
    (EVAL, Segment("<python>pri", "length", None, 0, tokens=4), 0, Step("done", "length")),
    (EVAL, Segment("", "length", None, 10, tokens=0), 0, Step("done", "length")),  # nothing written: no loop
    (RL, Segment("<search>q</search>", "stop", "</search>", 50, tokens=18), 1,
     Step("done", "tool_limit", ended_by_environment=True)),                      # call_limit 1 already used
    (RL, Segment("<search>q</search>", "stop", "</search>", 50, tokens=18), 0, Step("call", call=ToolCall("search", "q"))),
    (RL, Segment("  </search>", "stop", "</search>", 50, tokens=3), 0,
     Step("done", "empty_call", ended_by_environment=True)),                      # RL ends an empty call
    (EVAL, Segment("  </search>", "stop", "</search>", 50, tokens=3), 0,
     Step("call", call=ToolCall("search", ""))),                                   # eval lets the ToolBox answer
    (EVAL, Segment("x</python>", "stop", "</python>", 50, before="<think>t</think><python>print(", tokens=3), 0,
     Step("call", call=ToolCall("python", "print(x"))),                            # the call opened earlier
])
def test_next_step_table(rules, segment, calls, expected):
    assert next_step(rules, segment, calls) == expected


class Box:
    """A toolbox answering every call with its argument upper-cased."""

    def new_state(self):
        return None

    async def aexecute(self, call, state):
        from stages.agent.toolbox import ToolResult

        return ToolResult(call.tool, call.argument.upper(), True, 0.0, False)


def test_text_loop_continues_a_cut_call_and_renders_results():
    # the server's per-call cap cuts "<search>paris</search>" after "<search>pa" (3 tokens); the loop asks again
    replies = [TextSegment("<search>pa", "length", None, 3), TextSegment("ris</search>", "stop", "</search>", 2),
               TextSegment("<answer>P</answer>", "stop", ANSWER_STOP, 4)]

    async def generate(output, max_tokens, call):
        return replies[call]

    state = TextLoopState()
    asyncio.run(run_text_loop(generate, Box(), EVAL, TextBudget(3, 100, 10), state))
    assert state.output == "<search>paris</search> <result>\nPARIS\n</result><answer>P</answer>"
    assert (state.finish_reason, state.llm_calls, state.completion_tokens) == ("stop", 3, 9)
    assert state.tools_run["search"] == 1 and [r.text for r in state.results] == ["PARIS"]
    budget_state = TextLoopState()  # 5 tokens in all: the second reply spends them, the call is never run
    asyncio.run(run_text_loop(generate, Box(), EVAL, TextBudget(3, 5, 10), budget_state))
    assert budget_state.finish_reason == "length" and budget_state.tools_run["search"] == 1  # 5 - 3 - 2 = 0 left
    # (the call that completes exactly at the budget still runs: its segment ended on the stop)


def test_sampling_driver_is_the_rl_driver_without_branching():
    # ToolRollout (SFT's sampling) and RL's TreeRollout under rl.algorithm=grpo run the same loop: identical batches
    def run(driver_cls):
        tok = ToyTokenizer()
        driver = driver_cls(ScriptedBackend(tok, search_then_answer()), ToyToolBox(), tok, cfg(n=3, initial_rollouts=3),
                            seed=4, show_progress=False)
        return driver.rollout([PromptItem(0, tok.encode("user: q\nassistant:"), "q", "A", "qa")])

    plain, rl = run(ToolRollout), run(functools.partial(TreeRollout, algorithm="grpo"))
    strip = lambda b: [(t.response_ids, t.loss_mask, t.finish_reason, t.kind) for t in b.trajectories]
    assert strip(plain) == strip(rl) and len(plain.trajectories) == 3
    assert plain.trajectories[0].response_text.startswith(SEARCH)


def _imports(package: str) -> set[str]:
    found = set()
    for path in (PROJECT_ROOT / package.replace(".", "/")).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize(("package", "forbidden"), [
    ("stages.agent", ("stages.generation", "stages.rl", "stages.sft", "stages.eval")),
    ("stages.generation", ("stages.rl", "stages.sft", "stages.eval")),
    ("stages.sft", ("stages.rl", "stages.eval")),   # editing RL code must not change SFT's or DPO's outputs
    ("stages.eval", ("stages.rl", "stages.sft", "stages.generation", "stages.heldout")),
    ("stages.heldout", ("stages.rl",)),   # the in-process policy evaluation runs the shared runtime, not RL's code
])
def test_the_runtime_layer_sits_under_the_stages(package, forbidden):
    bad = sorted(m for m in _imports(package) if m.startswith(forbidden))
    assert not bad, f"{package} imports {bad}"
    assert Path(PROJECT_ROOT / package.replace(".", "/")).is_dir()
