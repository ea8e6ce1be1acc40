"""verl's per-step metrics in our monitoring: the local engine's rollout metrics computed from verl's rows, the
name mapping of verl's own metrics, following verl's file logger while it runs, and the live report (metrics.jsonl,
progress, curves, alarms)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stages.core.config.loader import load_config
from stages.rl.alarms import AlarmStop
from stages.rl.verl.monitor import Follower, LiveReport, logp_mismatch, our_row, read_steps, rollout_metrics


def test_rollout_metrics_of_a_verl_step_match_the_local_definitions():
    # two trees of n = 2: u (rewards 1, -1: one correct, one format error), v (0, 0: no signal)
    uids = ["u", "u", "v", "v"]
    extras = [{"arpo_tool_calls": 2, "arpo_tool_errors": 1, "arpo_branches": 1, "arpo_fresh": 0, "arpo_finish": "eos",
               "arpo_calls_by_tool": '{"python": 1, "search": 1}',
               "reward_extra_info": {"acc": 1.0, "f1": 1.0, "format_error": 0.0}},
              {"arpo_tool_calls": 0, "arpo_tool_errors": 0, "arpo_branches": 1, "arpo_fresh": 0, "arpo_finish": "length",
               "arpo_infra_failures": 2, "arpo_masked": 1,
               "reward_extra_info": {"acc": 0.0, "f1": 0.0, "format_error": 1.0}},
              {"arpo_tool_calls": 1, "arpo_tool_errors": 0, "arpo_branches": 0, "arpo_fresh": 1, "arpo_finish": "eos",
               "arpo_calls_by_tool": '{"search": 1}',
               "reward_extra_info": {"acc": 0.0, "f1": 0.5, "format_error": 0.0}},
              {"arpo_tool_calls": 1, "arpo_tool_errors": 0, "arpo_branches": 0, "arpo_fresh": 1, "arpo_finish": "eos",
               "reward_extra_info": {"acc": 0.0, "f1": 0.5, "format_error": 0.0}}]
    scores = torch.tensor([1.0, -1.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])   # 0 = tool token or padding
    lengths = torch.tensor([4, 4, 2, 3])
    entropy = torch.full((4, 4), 2.0)                                                 # nats
    row = rollout_metrics(uids, extras, scores, mask, lengths, entropy, vocab_size=100)
    assert row["reward/mean"] == 0.0 and row["reward/min"] == -1.0 and row["reward/max"] == 1.0
    assert row["reward/std"] == pytest.approx(math.sqrt(2 / 3))          # sample std of (1, -1, 0, 0)
    assert row["reward/format_error_rate"] == 0.25 and row["accuracy"] == 0.25 and row["f1"] == 0.5
    assert row["reward/groups_without_signal"] == 0.5                    # v: 0 == 0
    assert row["tools/calls_per_traj"] == 1.0 and row["tools/errors_per_traj"] == 0.25
    assert row["tools/infra_failures"] == 2.0                                        # row 1's two failures
    # per tool, as the local engine names them (rows without the field: no calls of any tool)
    assert row["tools/python_per_traj"] == 0.25 and row["tools/search_per_traj"] == 0.5
    assert row["tools/used_both_rate"] == 0.25
    assert row["rollout/masked_share"] == 0.25 and row["rollout/masked_trajectories"] == 1.0   # row 1 of 4
    assert row["rollout/branches_per_group"] == 0.5 and row["rollout/fresh_per_group"] == 0.5
    assert row["response/length"] == 3.25 and row["response/model_tokens"] == 2.5     # (3 + 4 + 1 + 2) / 4
    assert row["response/tool_tokens"] == 0.75                                        # (1 + 0 + 1 + 1) / 4
    assert row["finish/eos"] == 0.75 and row["finish/length"] == 0.25
    assert row["entropy/mean"] == pytest.approx(2.0 / math.log(100))                  # over model tokens, / ln|V|


def test_verl_names_map_to_ours_and_the_rest_is_kept_under_verl():
    row = our_row(3, {"arpo/reward/mean": 0.5, "arpo/tools/calls_per_traj": 1.5, "actor/pg_loss": 0.1,
                      "actor/grad_norm": 2.0, "timing_s/step": 12.0, "training/rollout_probs_diff_mean": 0.01,
                      "critic/score/mean": 0.5, "note": "text", "flag": True})
    assert row == {"step": 3, "reward/mean": 0.5, "tools/calls_per_traj": 1.5, "loss": 0.1, "grad_norm": 2.0,
                   "timing/step_s": 12.0, "rollout/prob_mismatch": 0.01, "verl/critic/score/mean": 0.5}


def test_logp_mismatch_is_the_mean_absolute_gap_over_response_tokens():
    # row 0: |-1.0 - -1.5| = 0.5 and |-2 - -2| = 0 on its two tokens; row 1: one token, |-0.1 - -0.4| = 0.3; the
    # masked positions (a tool result, padding) differ by 9 and must not count: (0.5 + 0 + 0.3) / 3
    rollout = torch.tensor([[-1.0, -2.0, -9.0], [-0.1, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -2.0, 0.0], [-0.4, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert logp_mismatch(rollout, old, mask) == pytest.approx(0.8 / 3)
    # row 1's token 0 as the EOS our tree loop appended after a refused call: no sampling log-prob, left out
    assert logp_mismatch(rollout, old, mask, [None, 0]) == pytest.approx(0.5 / 2)


def _log(path, *steps, value=1.0):
    with open(path, "a") as handle:
        for step in steps:
            handle.write(json.dumps({"step": step, "data": {"arpo/reward/mean": value * step}}) + "\n")


def test_follower_hands_each_step_once_and_a_redone_step_comes_from_the_last_attempt(tmp_path):
    first, second = tmp_path / "attempt_1.jsonl", tmp_path / "attempt_2.jsonl"
    seen = []
    follow = Follower(lambda: [first, second], seen.append)
    assert follow.poll() == []                                          # nothing logged yet
    _log(first, 1)
    follow.poll()
    with open(first, "a") as handle:
        handle.write('{"step": 2, "da')                                # a line being written
    assert follow.poll() == []
    first.write_text(first.read_text().rsplit("\n", 1)[0] + "\n")
    _log(second, 2, value=10.0)                                         # resumed after a crash
    follow.poll()
    assert [(r["step"], r["reward/mean"]) for r in seen] == [(1, 1.0), (2, 20.0)]
    assert read_steps([first, second])[2]["reward/mean"] == 20.0


class Bar:
    def __init__(self):
        self.updates = []

    def update(self, done, note=""):
        self.updates.append((done, note))


def test_live_report_writes_metrics_moves_the_bar_and_raises_alarms(tmp_path):
    cfg = load_config("tiny-cpu", ["rl.engine=verl", "rl.alarms.stop_on=[nonfinite_loss]"]).rl
    bar = Bar()
    live = LiveReport(cfg, tmp_path, bar, resumed_step=0)
    live.on_step({"step": 1, "reward/mean": 0.5, "tools/calls_per_traj": 1.0, "entropy/mean": 0.3, "loss": 0.1})
    assert bar.updates == [(1, "reward 0.500, tools/traj 1.00")]
    assert (tmp_path / "curves.png").is_file()                         # report_every 1
    with pytest.raises(AlarmStop, match="global_step_2 may exist"):
        live.on_step({"step": 2, "reward/mean": 0.5, "tools/calls_per_traj": 1.0, "entropy/mean": 0.3,
                      "loss": float("nan")})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["alarm/nonfinite_loss"] == 1.0
    assert "nonfinite_loss" in (tmp_path / "alarms.jsonl").read_text()
