"""The tree page of a real rollout dump (the tree rollout on the scripted backend, written by the trainer's own
dump and publish functions) in a headless chromium: it loads without a console error, the screenshot shows the
trees, and a click on a segment opens its text. About 3 s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stages.agent.rewards import Reward
from stages.rl.step_metrics import dump_rollouts
from stages.rl.tree_report import page_path, publish_trees
from tests.integration.tree_browser import check_tree_page
from tests.unit.test_rl_trees import arpo_batch

pytestmark = pytest.mark.integration


def test_the_page_renders_the_trees_and_a_click_opens_a_segment(tmp_path):
    batch, tok = arpo_batch()     # 2 groups of 6: 2 roots each and their copies (tests/unit/test_rl_trees.py)
    trajs = batch.trajectories
    rewards = [Reward(float(t.traj_id % 2), bool(t.traj_id % 2), "test", "A", 0.0) for t in trajs]
    dump_rollouts(tmp_path / "rollouts" / "step_000001.jsonl", 1, batch, rewards, tok, [0.1] * len(trajs))
    publish_trees(SimpleNamespace(algorithm="arpo", trainer=SimpleNamespace(dump_rollouts=True)), tmp_path)
    shown = check_tree_page(page_path(tmp_path, 1), tmp_path / "page.png")
    assert shown["errors"] == []
    assert shown["trees"] == 2 and shown["forks"] == sum(t.kind == "branch" for t in trajs)
    # one bar per generated segment and tool result of each trajectory's own part (a copy's starts at its fork)
    assert shown["bars"] == sum(len([s for s in t.meta["segments"] + t.meta["tool_spans"] if s[0] >= t.fork_at])
                                for t in trajs)
    assert shown["blue_pixels"] > 2000        # the bars are drawn (screenshot pixels, not only the DOM)
    assert shown["hidden_before"] and shown["visible_after"]
    assert "<search>q</search>" in shown["detail_text"] and "H 0.000" in shown["detail_text"]
