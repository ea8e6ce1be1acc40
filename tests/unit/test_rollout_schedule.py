"""The `early_tools` schedule gives the same rollout batch as `rounds`, bit for bit, through the local engine's driver
(TreeRollout), for GRPO, ARPO and AEPO under both entropy windows.

The backend answers a round's requests in reverse order (`generate_iter`), so early tool calls really start before
the round's generations are all back (checked by waiting for the first call before the last answer). The toolbox's
result says how many calls its trajectory's CallState holds (`#k`), so a copy forked at a segment's start (paper
window) that saw its parent's new call would read a different result: the CallState snapshot is what keeps it equal.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from stages.core.config.rl import RolloutSection
from stages.generation.prompt_items import PromptItem
from stages.rl.rollout import TreeRollout
from tests.unit.test_rl_rollout_fakes import EOS, ScriptedBackend, ToyResult, ToyTokenizer, ToyToolBox

WAIT_S = 30.0  # ceiling of the wait for an early call (never reached when it works)


@dataclasses.dataclass
class ReversedBackend(ScriptedBackend):
    """Answers a round's requests last first; before the last answer, when an earlier answer of the round ended in
    a call, it waits for a tool call to start (`early`: whether one did)."""

    tool_started: threading.Event = dataclasses.field(default_factory=threading.Event)
    early: list[bool] = dataclasses.field(default_factory=list)

    def generate_iter(self, requests, sampling, seed=None):
        self.tool_started.clear()
        results = self.generate(requests, sampling, seed)
        order = list(reversed(range(len(results))))
        for n, i in enumerate(order):
            if n == len(order) - 1 and any(results[j].finish_reason == "stop" for j in order[:-1]):
                self.early.append(self.tool_started.wait(WAIT_S))
            yield i, results[i]


class CountingToolBox(ToyToolBox):
    """ToyToolBox whose result names the calls its CallState holds, and which signals each call's start."""

    def __init__(self, started: threading.Event | None = None) -> None:
        super().__init__()
        self.started, self.lock = started, threading.Lock()

    def execute_many(self, calls):
        if self.started is not None:
            self.started.set()
        with self.lock:
            self.batches.append([(c.tool, c.argument) for c, _ in calls])
        out = []
        for call, state in calls:
            state.calls.append(call.argument)
            out.append(ToyResult(call.tool, f"R:{call.argument}#{len(state.calls)}", True))
        return out


def policy(ctx: str, key) -> tuple[str, float]:
    """Up to three searches, then an answer; queries and entropies vary with the trajectory and the round."""
    results = ctx.count("</result>")
    salt = sum(map(ord, str(key))) + 7 * results
    if results >= 1 + salt % 3:
        return "<answer>A</answer>" + EOS, 0.1 + (salt % 5) / 10
    return f"<search>q{salt % 4}</search>", 0.05 * (salt % 7)


def section(window: str, **kw) -> RolloutSection:
    base = {"n": 6, "initial_rollouts": 2, "beam_size": 3, "branch_probability": 0.5, "entropy_weight": 0.5,
            "call_limit": 3, "max_prompt_length": 64, "max_response_length": 240, "entropy_tokens": 8,
            "entropy_window": window, "entropy_aggregation": "mean"}
    return RolloutSection(**{**base, **kw})


def rollout(schedule: str, algorithm: str, cfg: RolloutSection, seed: int, script=policy):
    tok = ToyTokenizer()
    started = threading.Event()
    backend = ReversedBackend(tok, script, tool_started=started)
    box = CountingToolBox(started if schedule == "early_tools" else None)
    driver = TreeRollout(backend, box, tok, cfg.model_copy(update={"schedule": schedule}), algorithm, seed=seed,
                         show_progress=False)
    prompts = [PromptItem(g, tok.encode(f"user: question {g}\nassistant:"), f"question {g}", "A", "qa")
               for g in range(3)]
    return driver.rollout(prompts), backend


def snapshot(batch) -> list:
    """Everything of a batch but its timings: every trajectory field (ids, masks, log-probs, entropies, fork
    points, draws, spans, counters) and each group's tree bookkeeping."""
    out = []
    for g in batch.groups:
        out.append((g.group, g.initial_rollouts, g.branches, g.fresh, g.meta,
                    [dataclasses.asdict(t) for t in g.trajectories]))
    return out


CASES = [("grpo", {}), ("arpo", {}), ("aepo", {"dynamic_rollouts": True, "branch_penalty": 0.3})]


@pytest.mark.parametrize("window", ["reference", "paper"])
@pytest.mark.parametrize("algorithm,extra", CASES, ids=[c[0] for c in CASES])
def test_early_tools_gives_the_rounds_batch_bit_for_bit(algorithm, extra, window):
    branched = 0
    for seed in range(4):
        cfg = section(window, **extra)
        rounds, _ = rollout("rounds", algorithm, cfg, seed)
        early, backend = rollout("early_tools", algorithm, cfg, seed)
        assert snapshot(early) == snapshot(rounds)
        assert backend.early and all(backend.early)    # a call started before the round's last answer
        assert early.metrics["tool_calls"] == rounds.metrics["tool_calls"] > 0
        branched += sum(g.branches for g in rounds.groups)
    assert (branched > 0) == (algorithm != "grpo")     # the trees did branch: the comparison covers forks


def test_paper_window_copy_takes_the_call_state_of_its_segment_start():
    """Two searches, then an answer: the copy forks at the start of its parent's second segment (after one result)
    and makes the second call itself, which its CallState must count as the second (#2), not the third, under
    both schedules (early_tools has already run the parent's second call when the copy is made)."""
    two_searches = lambda ctx, key: ("<search>q</search>", 0.2) if ctx.count("</result>") < 2 else ("<answer>A</answer>"
                                                                                               + EOS, 0.2)
    cfg = section("paper", n=2, initial_rollouts=1, beam_size=2, branch_probability=1.0, entropy_weight=0.0)
    for schedule in ("rounds", "early_tools"):
        batch, _ = rollout(schedule, "arpo", cfg, 0, two_searches)
        for g in batch.groups:
            root, copy = g.trajectories
            assert copy.kind == "branch" and copy.parent_id == root.traj_id
            text = ToyTokenizer().decode(copy.response_ids[copy.fork_at:])
            parent_calls = ToyTokenizer().decode(root.response_ids[:copy.fork_at]).count("</result>")
            assert f"#{parent_calls + 1}\n</result>" in text


def test_unknown_schedule_is_refused():
    tok = ToyTokenizer()
    from stages.generation.tool_rollout import ToolRollout

    with pytest.raises(ValueError, match="unknown rollout schedule 'later'.*rounds, early_tools"):
        ToolRollout(ScriptedBackend(tok, policy), ToyToolBox(), tok, section("paper").generation(), schedule="later")


@pytest.mark.parametrize("schedule", ["rounds", "early_tools", "async"])
def test_the_card_calls_every_schedule_the_reference_algorithm(schedule):
    from stages.core.config.loader import load_config
    from stages.rl.card import algorithm_card

    rl = load_config("tiny-cpu", [f"rl.rollout.schedule={schedule}", "rl.algorithm=arpo"]).rl
    (row,) = [r for r in algorithm_card(rl).rows if r.mechanism == "rollout schedule"]
    assert row.verdict == "same" and row.value.startswith(schedule) and row.reference.startswith("rounds")
    assert ("bit for bit" in row.why) == (schedule == "early_tools")
    assert ("same distribution" in row.why) == (schedule == "async")
    assert row.link == "docs/reference.md#rollout-schedule"
