"""Every RL step says where its rollout's time went (issue 55): generate time, tool time, tool queueing and calls per
round, on the local engine (the batch's metrics -> the step row) and on verl (each tree's split -> extra fields ->
the trainer mode's metrics -> metrics.jsonl), and on the step's progress line; the algorithm card's tool-pool row."""

from __future__ import annotations

import pytest
import torch

from stages.agent.toolbox import ToolBox
from stages.agent.tools import ToolEnv
from stages.core.config.agent import AgentSection
from stages.core.config.loader import load_config
from stages.generation.prompt_items import PromptItem
from stages.rl.card import algorithm_card
from stages.rl.rollout import TreeRollout
from stages.rl.step_metrics import step_note, step_time_split
from stages.rl.verl.monitor import LiveReport, rollout_metrics
from stages.rl.verl.tree import tree_outputs
from tests.unit.test_no_silent_hang import StuckSearch
from tests.unit.test_rl_rollout import cfg, search_then_answer
from tests.unit.test_rl_rollout_fakes import ScriptedBackend, ToyTokenizer
from tests.unit.test_rl_verl_monitor import Bar


@pytest.fixture
def batch(tmp_path):
    agent = AgentSection.model_validate({"cache": {"enabled": False}})
    tok = ToyTokenizer()
    with ToolBox(agent, {"search": StuckSearch(agent, ToolEnv())}) as box:
        driver = TreeRollout(ScriptedBackend(tok, search_then_answer()), box, tok, cfg(n=2, initial_rollouts=2),
                             "grpo", show_progress=False)
        yield driver.rollout([PromptItem(0, tok.encode("user: q\nassistant:"), "q", "A", "qa")])


def test_the_local_rollout_splits_its_time(batch):
    # two roots: round 1 both search (2 calls), round 2 both answer (0 calls) -> 2 calls over 2 rounds
    split = step_time_split(batch.metrics)
    assert set(split) == {"timing/generate_s", "timing/tools_s", "timing/tool_queue_s", "tools/calls_per_round",
                          "tools/offered"}
    assert split["tools/calls_per_round"] == 1.0 and split["tools/offered"] == 1.0
    assert split["timing/generate_s"] > 0 and split["timing/tools_s"] > 0 and split["timing/tool_queue_s"] >= 0
    assert split["timing/tool_queue_s"] <= split["timing/tools_s"]


def test_a_verl_tree_sends_its_split_and_the_step_averages_the_trees(batch):
    outputs = tree_outputs(batch)
    fields = [o["extra_fields"] for o in outputs]
    assert len(fields) == 2 and fields[0]["arpo_time_generate_s"] == batch.metrics["time_generate_s"]
    assert all(f["arpo_calls_per_round"] == 1.0 and f["arpo_tools_offered"] == 1.0 for f in fields)
    assert fields[0]["arpo_time_tool_queue_s"] == fields[1]["arpo_time_tool_queue_s"]   # one tree, one split
    # two trees of two rows: the step's value is the mean over trees (each counted once)
    extras = [{"arpo_time_generate_s": 10.0, "arpo_time_tools_s": 4.0, "arpo_time_tool_queue_s": 1.0,
               "arpo_calls_per_round": 3.0, "arpo_tools_offered": 2.0}] * 2 + \
             [{"arpo_time_generate_s": 20.0, "arpo_time_tools_s": 8.0, "arpo_time_tool_queue_s": 3.0,
               "arpo_calls_per_round": 5.0, "arpo_tools_offered": 2.0}] * 2
    row = rollout_metrics(["u", "u", "v", "v"], extras, torch.zeros(4), torch.ones(4, 2), torch.full((4,), 2),
                          None, vocab_size=100)
    assert (row["timing/generate_s"], row["timing/tools_s"], row["timing/tool_queue_s"]) == (15.0, 6.0, 2.0)
    assert row["tools/calls_per_round"] == 4.0 and row["tools/offered"] == 2.0


def test_the_progress_line_shows_the_split(tmp_path):
    row = {"step": 1, "reward/mean": 0.5, "tools/calls_per_traj": 1.0, "entropy/mean": 0.3, "loss": 0.1,
           "timing/generate_s": 12.04, "timing/tools_s": 30.0, "timing/tool_queue_s": 21.5,
           "tools/calls_per_round": 60.0, "tools/offered": 2.0}
    expected = "reward 0.500, tools/traj 1.00, generate 12.0s, tools 30.0s (queued 21.5s, 60.0 calls/round)"
    assert step_note(row) == expected
    bar = Bar()
    LiveReport(load_config("tiny-cpu", ["rl.engine=verl"]).rl, tmp_path, bar, resumed_step=0).on_step(row)
    assert bar.updates == [(1, expected)]
    assert '"timing/tool_queue_s": 21.5' in (tmp_path / "metrics.jsonl").read_text()


def test_the_card_says_where_the_tool_pool_size_comes_from():
    paper = load_config("aepo-qwen3-14b-deepsearch")
    (row,) = [r for r in algorithm_card(paper.rl, paper.agent).rows if r.mechanism == "tool threads per rollout worker"]
    assert (row.value, row.reference, row.verdict) == ("64", "64", "same")
    assert row.link == "docs/reference.md#tool-pool"
    tiny = load_config("tiny-cpu")
    (row,) = [r for r in algorithm_card(tiny.rl, tiny.agent).rows if r.mechanism == "tool threads per rollout worker"]
    assert (row.value, row.verdict) == ("4", "differs") and "agent.concurrency" in row.why
    assert all(r.mechanism != "tool threads per rollout worker" for r in algorithm_card(tiny.rl).rows)
