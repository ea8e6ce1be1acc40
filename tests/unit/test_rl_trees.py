"""Rollout trees: the branch decisions the rollout records (scripted backend, tests/unit/test_rl_rollout_fakes.py),
the dump's tree fields, the tree model, its text and its statistics on hand-made rows, and `arpo trees`' resolution.

Token lengths of the scripted trajectories (tests/unit/test_rl_rollout.py's docstring): a search segment is 18 model
tokens, its result 8 tool tokens, the answer 19 model tokens (EOS included).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from stages.core.atomic import write_jsonl
from stages.core.errors import BadInputError, MissingInputError
from stages.rl.branching import (
    aepo_branch_probability,
    aepo_should_branch,
    arpo_branch_probability,
    arpo_should_branch,
)
from stages.rl.tree_record import entropy_bins, extra_tree_fields, trajectory_tree_fields
from stages.rl.tree_report import page_path, publish_trees, rl_stage, trees_report
from stages.rl.trees import build_trees, render_group, step_stats
from stages.rl.verl.tree import tree_outputs
from tests.unit.test_rl_rollout import ANSWER, SEARCH, cfg, run

# ---- P(branch) ---------------------------------------------------------------------------------------------------

def test_branch_probabilities_by_hand_and_against_the_rules():
    # ARPO: P = clip(tau + w dH): 0.5 + 0.2 * 1 = 0.7; tau >= 1 always, tau < 0 never
    assert arpo_branch_probability(0.5, 0.2, 1.0) == pytest.approx(0.7)
    assert arpo_branch_probability(1.0, 0.2, -9.0) == 1.0 and arpo_branch_probability(-0.1, 0.2, 9.0) == 0.0
    # AEPO: f = 1 - 0.5 * 1 = 0.5; branch iff (u + 0.2) * 0.5 >= 0.5 iff u >= 0.8: P = 0.2
    assert aepo_branch_probability(0.5, 0.2, 1.0, 1, 0.5) == pytest.approx(0.2)
    assert aepo_branch_probability(0.5, 0.2, 1.0, 2, 0.5) == 0.0          # f = 0 never branches
    # P is the share of u on a fine grid of [0, 1) that the rule branches on (within one grid step)
    grid = [i / 10_000 for i in range(10_000)]
    for tau, w, dh in ((0.5, 0.2, 1.0), (0.3, 1.0, -0.1), (0.9, 0.5, 0.4)):
        share = sum(arpo_should_branch(u, tau, w, dh) for u in grid) / len(grid)
        assert share == pytest.approx(arpo_branch_probability(tau, w, dh), abs=2e-4)
        for c, penalty in ((0, 0.2), (1, 0.2), (3, 0.25)):
            share = sum(aepo_should_branch(u, tau, w, dh, c, penalty) for u in grid) / len(grid)
            assert share == pytest.approx(aepo_branch_probability(tau, w, dh, c, penalty), abs=2e-4)


# ---- what the rollout records ----------------------------------------------------------------------------------

def searches_twice(ctx: str, key) -> tuple[str, float]:
    """Two searches (entropy 0.0 then 0.1 per token), then the answer (0.5 per token)."""
    results = ctx.count("</result>")
    return (SEARCH, 0.1 * results) if results < 2 else (ANSWER, 0.5)


def arpo_batch():
    # reference window, tau 0.3, w 1, sum over 20 tokens: the search segments sum to 0.0 and 1.8 (18 x 0.1)
    section = cfg(n=6, initial_rollouts=2, branch_probability=0.3, entropy_weight=1.0, entropy_window="reference",
                  beam_size=2)
    _, batch, _, _, tok = run(searches_twice, section, n_prompts=2, algorithm="arpo")
    return batch, tok


def test_every_draw_is_recorded_with_what_decided_it():
    batch, _ = arpo_batch()
    for group in batch.groups:
        by_id = {t.traj_id: t for t in group.trajectories}
        made = {}
        for t in group.trajectories:
            for d in t.meta.get("draws", []):
                # the rule on the recorded numbers gives the recorded outcome; P = clip(0.3 + dH)
                assert d["branch"] == arpo_should_branch(d["u"], 0.3, 1.0, d["dh"])
                assert d["p"] == pytest.approx(min(1.0, max(0.0, 0.3 + d["dh"])), abs=1e-6)
                assert d["dh"] == pytest.approx(d["h"] - d["h0"], abs=1e-5)
                # reference window: decided after call `call`'s result, the copy forks right after it
                assert d["at"] == 26 * d["call"] and d["seg"] == [d["at"] - 26, d["at"] - 8]
                if d["branch"]:
                    made[d["child"]] = (t.traj_id, d["at"])
                else:
                    assert d["child"] is None
        copies = {t.traj_id: (t.parent_id, t.fork_at) for t in group.trajectories if t.kind == "branch"}
        assert made == copies and len(copies) == group.branches      # one recorded draw per copy, and no other
        for child, (_, at) in copies.items():
            assert by_id[child].meta["inherited_tool_calls"] == at // 26   # the tool call the fork follows


def test_tool_spans_and_the_penalty_counter():
    batch, _ = arpo_batch()
    root = batch.groups[0].trajectories[0]
    assert root.meta["tool_spans"] == [[18, 26, "search", "ok", 1], [44, 52, "search", "ok", 2]]
    copy = next(t for t in batch.groups[0].trajectories if t.kind == "branch" and t.fork_at == 52)
    assert copy.meta["tool_spans"] == root.meta["tool_spans"]        # its prefix holds both results
    # AEPO, penalty 1, tau 1e-9, w 0 (tests/unit/test_rl_rollout.py): c is 0 on the first draw (copy 1 made), then
    # 1 on round 2's draw (factor 0: no copy)
    section = cfg(n=8, initial_rollouts=1, beam_size=2, branch_probability=1e-9, entropy_weight=0.0,
                  branch_penalty=1.0, call_limit=3)
    _, aepo, _, _, _ = run(lambda ctx, key: (SEARCH, 0.0), section, algorithm="aepo")
    first = aepo.groups[0].trajectories[0].meta["draws"]
    assert [(d["c"], d["branch"], d["p"]) for d in first[:2]] == [(0, True, 1.0), (1, False, 0.0)]


def test_dump_tree_fields_count_retrained_prefix_tokens():
    batch, tok = arpo_batch()
    group = batch.groups[0]
    fields = {t.traj_id: trajectory_tree_fields(t, group, tok) for t in group.trajectories}
    for t in group.trajectories:
        f = fields[t.traj_id]
        # every trajectory: 18 + 18 + 19 model tokens; a copy forked after call k shares k x 18 of them
        assert f["loss_tokens"] == 55
        assert f["retrained_prefix_tokens"] == (18 * (t.fork_at // 26) if t.kind == "branch" else 0)
    root = fields[0]["tree"]
    # characters: "<search>q</search>" is 18, its result " <result>\nR:q\n</result>" 23 characters
    assert dict(map(tuple, root["chars"]))[26] == 41 and root["group"] == {"n": 6, "initial": 2, "branches":
                                                                           group.branches, "fresh": group.fresh}
    masked = group.trajectories[0]
    masked.infra_failures = 1
    assert trajectory_tree_fields(masked, group, tok)["loss_tokens"] == 0


def test_verl_rows_carry_the_same_tree_fields():
    batch, tok = arpo_batch()
    one = SimpleNamespace(groups=[batch.groups[0]], metrics={})
    for traj, out in zip(batch.groups[0].trajectories, tree_outputs(one)):
        got = extra_tree_fields(out["extra_fields"], out["response_ids"], out["response_mask"], tok)
        assert got == json.loads(json.dumps(trajectory_tree_fields(traj, batch.groups[0], tok)))
    with pytest.raises(ValueError, match="arpo_tree"):
        extra_tree_fields({}, [1], [1], tok)


def test_entropy_bins_average_model_tokens():
    # size ceil(5 / 2) = 3: bin 0 = tokens 0-2, model ones 0.1, 0.2 -> 0.15; bin 1 = tokens 3-4, model 0.4
    assert entropy_bins([0.1, 0.2, 0.0, 0.0, 0.4], [1, 1, 0, 0, 1], bins=2) == {"bin": 3, "h": [0.15, 0.4]}
    assert entropy_bins([0.1, 0.2, 0.0, 0.0, 0.4], [1, 1, 0, 0, 1], bins=5)["h"] == [0.1, 0.2, None, None, 0.4]


# ---- the tree model on hand-made rows ------------------------------------------------------------------------------

def row(group, tid, kind, parent, fork_at, reward, loss, retrained, segments, tools, draws, response, chars,
        h_initial=1.0):
    return {"group": group, "traj_id": tid, "kind": kind, "parent_id": parent, "fork_at": fork_at,
            "question": f"q {group}", "ground_truth": "7", "response": response, "length": chars[-1][0],
            "reward": {"score": reward, "answer": "7" if reward == 1 else "3"}, "advantage": reward - 0.25,
            "finish_reason": "eos", "loss_tokens": loss, "retrained_prefix_tokens": retrained,
            "tree": {"segments": segments, "tool_spans": tools, "draws": draws, "h_initial": h_initial,
                     "fork_call": 1 if parent is not None else 0, "entropy": {"bin": 1, "h": []},
                     "group": {"n": 4, "initial": 2, "branches": 2, "fresh": 0}, "chars": chars}}


def draw(seg, at, dh, p, branch, child=None):
    return {"seg": seg, "h": 1.0 + dh, "h0": 1.0, "at": at, "call": 1, "dh": dh, "c": 0, "p": p, "u": 0.5,
            "branch": branch, "child": child}


def hand_rows() -> list[dict]:
    """g0: root 0 (tokens: model [0,3) "abc", tool [3,5) "RR", model [5,10) "defgh"), its copy 1 forked at 5 (model
    [5,9) "wxyz"), copy 2 of 1 forked at 5 too; root 3 (model [0,6)). g1: root 4 and fresh 5 (no tree fields: an
    older dump). Rewards: 1, 0, 0, 0.5 | 0, 0."""
    chars10 = [[0, 0], [3, 3], [5, 5], [10, 10]]
    return [
        row("g0", 0, "root", None, 0, 1.0, 10, 0, [[0, 3, False, 1.0], [5, 10, True, 1.5]],
            [[3, 5, "python", "ok", 1]], [draw([0, 3], 5, 0.5, 0.6, True, 1), draw([0, 3], 5, 0.5, 0.6, False)],
            "abcRRdefgh", chars10),
        row("g0", 1, "branch", 0, 5, 0.0, 10, 3, [[0, 3, False, 1.0], [5, 9, True, 0.8]],
            [[3, 5, "python", "ok", 1]], [draw([5, 9], 5, -0.2, 0.4, True, 2)], "abcRRwxyz",
            [[0, 0], [3, 3], [5, 5], [9, 9]]),
        row("g0", 2, "branch", 1, 5, 0.0, 8, 5, [[0, 3, False, 1.0], [5, 7, True, 0.9]],
            [[3, 5, "python", "ok", 1]], [], "abcRRuv", [[0, 0], [3, 3], [5, 5], [7, 7]]),
        row("g0", 3, "root", None, 0, 0.5, 6, 0, [[0, 6, False, 1.2]], [], [], "qrstuv", [[0, 0], [6, 6]], 1.2),
        {"group": "g1", "traj_id": 4, "kind": "root", "parent_id": -1, "fork_at": 0, "response": "x" * 5,
         "length": 5, "reward": {"score": 0.0}, "advantage": 0.0, "finish_reason": "length", "loss_tokens": 5},
        {"group": "g1", "traj_id": 5, "kind": "fresh", "parent_id": None, "fork_at": 0, "response": "y" * 5,
         "length": 5, "reward": {"score": 0.0}, "advantage": 0.0, "finish_reason": "length", "loss_tokens": 5},
    ]


def test_trees_structure_and_statistics_by_hand():
    groups = build_trees(hand_rows())
    assert [g.group for g in groups] == ["g0", "g1"]
    g0 = groups[0]
    assert [[n.traj_id for n in r.walk()] for r in g0.roots] == [[0, 1, 2], [3]]
    assert [n.depth for n in g0.nodes()] == [0, 1, 2, 0] and g0.depth == 2
    assert [(p.kind, p.start, p.end, p.text) for p in g0.roots[0].pieces()] == [
        ("model", 0, 3, "abc"), ("tool", 3, 5, "RR"), ("model", 5, 10, "defgh")]
    assert [(p.kind, p.text) for p in g0.roots[0].children[0].pieces()] == [("model", "wxyz")]
    stats = step_stats(groups)
    # roots: g0 2, g1 1 (the fresh root counts apart); copies 2 + 0; depth 2 and 0; retrained (3 + 5) / 44 tokens;
    # families: 0 with copy 1 (rewards 1, 0: spread 1), 1 with copy 2 (0, 0: spread 0); draws: 3, two branched,
    # dH (0.5 + 0.5 - 0.2) / 3, P (0.6 + 0.6 + 0.4) / 3; rewards (1 + 0.5) / 6
    assert stats == pytest.approx({
        "groups": 2, "trajectories": 6, "roots_per_group": 1.5, "branches_per_group": 1.0, "fresh_per_group": 0.5,
        "depth_mean": 1.0, "depth_max": 2, "retrained_prefix_share": 8 / 44, "sibling_reward_spread": 0.5,
        "families_with_spread": 0.5, "draws": 3, "draw_branch_rate": 2 / 3, "draw_dh_mean": 0.8 / 3,
        "draw_p_mean": 1.6 / 3, "reward_mean": 0.25})


def test_text_is_one_line_per_segment_with_copies_at_their_fork():
    text = render_group(build_trees(hand_rows())[0]).splitlines()
    assert text == [
        "group g0 · n 4 · roots 2 · copies 2 · fresh 0 · depth 2",
        "  Q: q g0",
        "  gold: 7",
        '  #0 root · reward +1.00 · adv +0.750 · eos · answer "7" · loss 10 tok (0 retrained)',
        "    [0,3) H 1.000 (baseline) → python #1 ok [3,5) | draws: c 0 p 0.60 u 0.50 → #1; c 0 p 0.60 u 0.50 "
        "no copy",
        '      #1 branch of #0 @5 after call 1 · reward +0.00 · adv -0.250 · eos · answer "3" · loss 10 tok '
        '(3 retrained)',
        '          #2 branch of #1 @5 after call 1 · reward +0.00 · adv -0.250 · eos · answer "3" · loss 8 tok '
        '(5 retrained)',
        "            [5,7) H 0.900 dH -0.100",
        "        [5,9) H 0.800 dH -0.200 | draws: c 0 p 0.40 u 0.50 → #2",
        "    [5,10) H 1.500 dH +0.500",
        '  #3 root · reward +0.50 · adv +0.250 · eos · answer "3" · loss 6 tok (0 retrained)',
        "    [0,6) H 1.200 (baseline)",
    ]
    old = render_group(build_trees(hand_rows())[1]).splitlines()
    assert old[3:] == ["  #4 root · reward +0.00 · adv +0.000 · length · answer none · loss 5 tok (0 retrained)",
                       "    [0,5) response (5 tok)",
                       "  #5 fresh · reward +0.00 · adv +0.000 · length · answer none · loss 5 tok (0 retrained)",
                       "    [0,5) response (5 tok)"]


def test_rows_without_ids_are_refused_with_their_row():
    with pytest.raises(BadInputError, match="dump.jsonl row 2 has no traj_id"):
        build_trees([hand_rows()[0], {"group": "g0"}], "dump.jsonl")


# ---- on disk: pages, artifacts, arpo trees ------------------------------------------------------------------------

def stage_folder(tmp_path):
    stage = tmp_path / "rl" / "abc"
    write_jsonl(stage / "rollouts" / "step_2.jsonl", hand_rows())
    write_jsonl(stage / "rollouts" / "step_10.jsonl", hand_rows()[:4])
    return stage


def test_publish_writes_a_page_per_step_once_and_never_into_a_finished_folder(tmp_path, monkeypatch):
    from stages.core import reporter

    sent = []
    monkeypatch.setattr(reporter, "send", lambda kind, **fields: sent.append((kind, fields["key"])))
    cfg_ = SimpleNamespace(algorithm="arpo", trainer=SimpleNamespace(dump_rollouts=True))
    stage = stage_folder(tmp_path)
    publish_trees(cfg_, stage, write=False)                   # a finished folder: nothing written
    assert not (stage / "trees").exists()
    publish_trees(cfg_, stage)
    assert page_path(stage, 2).is_file() and page_path(stage, 10).is_file()
    assert (stage / "trees" / "step_000010.png").stat().st_size > 5000   # the newest step (10 > 2 by number)
    assert ("image", "rl-trees") in sent and ("markdown", "rl-tree-pages") in sent
    before = page_path(stage, 2).stat().st_mtime_ns
    os.utime(page_path(stage, 10), (1, 1))                  # older than its dump: a redone step, rewritten
    publish_trees(cfg_, stage)
    assert page_path(stage, 2).stat().st_mtime_ns == before and page_path(stage, 10).stat().st_mtime > 1


def test_arpo_trees_resolves_runs_and_prints_the_step(tmp_path):
    stage = stage_folder(tmp_path)
    run = tmp_path / "outputs" / "runs" / "tiny-1"
    run.mkdir(parents=True)
    (run / "refs.json").write_text(json.dumps({"rl": {"meta": {"rollouts": str(stage / "rollouts")}}}))
    (run.parent / "latest").symlink_to(run.name)
    assert rl_stage("latest", tmp_path / "outputs") == stage == rl_stage(run) == rl_stage(stage / "rollouts")
    text = trees_report("latest", output_root=tmp_path / "outputs")
    assert "step 10 (" in text and "group g1" not in text               # the newest step by default
    summary = text.split("\n\n")[1].splitlines()
    assert [line.split()[0] for line in summary[1:]] == ["2", "10"]      # one line per step, in step order
    one = trees_report(stage, step=2, group="g1", html=tmp_path / "pages")
    assert "group g1" in one and "group g0" not in one
    assert sorted(p.name for p in (tmp_path / "pages").iterdir()) == ["step_000002.html", "step_000010.html"]
    assert not (stage / "trees").exists()                                 # the stage folder is left alone
    with pytest.raises(BadInputError, match=r"no dump of step 3 .* dumped steps: \[2, 10\]"):
        trees_report(stage, step=3)
    with pytest.raises(BadInputError, match="has no group 'g9'"):
        trees_report(stage, step=2, group="g9")
    with pytest.raises(MissingInputError, match="neither an RL stage folder"):
        rl_stage(tmp_path / "nothing", tmp_path / "outputs")


def test_a_bad_dump_never_stops_the_run(tmp_path):
    cfg_ = SimpleNamespace(algorithm="arpo", trainer=SimpleNamespace(dump_rollouts=True))
    write_jsonl(tmp_path / "rollouts" / "step_1.jsonl", [{"group": 0}])      # no traj_id
    publish_trees(cfg_, tmp_path)                                             # logged, not raised
    assert not page_path(tmp_path, 1).exists()


def test_a_copy_whose_first_segment_sets_its_baseline_says_so(tmp_path):
    # reference window: a copy forked after call 1 (token 26) measures its baseline on its own first segment
    # [26, 44) (H = 18 x 0.1 = 1.8), so that line reads "(baseline)", not "dH +0.000"
    from stages.agent.rewards import Reward
    from stages.core.atomic import read_jsonl
    from stages.rl.step_metrics import dump_rollouts

    batch, tok = arpo_batch()
    rewards = [Reward(0.0, False, "test", None, 0.0) for _ in batch.trajectories]
    dump_rollouts(tmp_path / "d.jsonl", 1, batch, rewards, tok, [0.0] * len(batch.trajectories))
    text = render_group(build_trees(read_jsonl(tmp_path / "d.jsonl"))[0])
    copy = next(t for t in batch.groups[0].trajectories if t.kind == "branch" and t.fork_at == 26)
    assert f"#{copy.traj_id} branch of #{copy.parent_id} @26 after call 1" in text
    assert "[26,44) H 1.800 (baseline) → search #2 ok [44,52)" in text


def test_the_probe_root_count_reaches_the_dump_and_the_text():
    # AEPO's probe, reference window, summed (tests/unit/test_rl_rollout.py): H_root 18, H_tool 9 -> 4 roots
    from tests.unit.test_rl_rollout import search_then_answer

    section = cfg(n=4, initial_rollouts=1, dynamic_rollouts=True, branch_probability=1.0, branch_penalty=0.05,
                  entropy_weight=0.0)
    _, batch, _, _, tok = run(search_then_answer(1.0, 0.0), section, algorithm="aepo")
    (g,) = batch.groups
    info = trajectory_tree_fields(g.trajectories[0], g, tok)["tree"]["group"]
    assert info == {"n": 4, "initial": 4, "branches": 0, "fresh": 0, "h_root": 18.0, "h_tool": 9.0}
    rows = [{"group": 0, "traj_id": t.traj_id, "kind": t.kind, "length": len(t), "response": t.response_text,
             **trajectory_tree_fields(t, g, tok)} for t in g.trajectories]
    assert "· probe H_root 18.000 H_tool 9.000 → 4 roots" in render_group(build_trees(rows)[0]).splitlines()[0]


def test_finish_pages_writes_every_page_and_never_raises(tmp_path):
    from stages.rl.tree_report import finish_pages

    cfg_ = SimpleNamespace(algorithm="arpo", trainer=SimpleNamespace(dump_rollouts=True))
    stage = stage_folder(tmp_path)
    finish_pages(cfg_, stage)
    assert page_path(stage, 2).is_file() and page_path(stage, 10).is_file()
    write_jsonl(stage / "rollouts" / "step_11.jsonl", [{"group": 0}])      # a bad row: logged
    finish_pages(cfg_, stage)
    assert not page_path(stage, 11).exists()


def test_a_big_step_shows_less_text_per_piece(monkeypatch):
    from stages.rl import tree_page

    groups = build_trees(hand_rows())   # pieces: g0 3 + 1 + 1 + 1, g1 1 + 1 = 8
    assert tree_page.text_limit(groups) == 6000                           # 24e6 / 8 is over MAX_TEXT
    monkeypatch.setattr(tree_page, "TEXT_BUDGET", 4000)
    assert tree_page.text_limit(groups) == 500                            # 4000 / 8
    monkeypatch.setattr(tree_page, "TEXT_BUDGET", 800)
    assert tree_page.text_limit(groups) == 400                            # the floor
    assert tree_page.clip_text("a" * 10 + "b" * 10, 10) == "aaaaa\n[… 10 characters not shown …]\nbbbbb"


def test_the_curves_and_the_trees_are_saved_atomically_and_closed(tmp_path):
    # one helper for both figures (stages.core.atomic.save_figure): the PNG appears whole, no temp file stays, and
    # the figure is closed (a run plots every step)
    import matplotlib.pyplot as plt

    from stages.rl.step_metrics import plot_curves

    png = plot_curves([{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.3}], tmp_path / "c" / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["c.png"] and plt.get_fignums() == []
