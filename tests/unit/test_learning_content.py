"""Protocol v2 (bench/learning_content.py, docs/learning.md): content accuracy of GRPO(task) - GRPO(format-only) by
seed-level t-test, its MDE and seeds, the generated verdict lines, and the pilot's selection rule; every expected
value derived by hand in the comments (t quantiles from t tables)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import learning_content as lc
from bench import learning_protocol as lp
from bench import learning_questions as lq
from bench import learning_stats as st

QUESTIONS = ["q0", "q1"]


def result(policy: str, seed: int, content: list[int]) -> dict:
    """A worker's results file with content counts (2 samples per question): format-strict counts one below."""
    algorithm = "grpo" if policy in ("sft", "format") else policy
    return {"algorithm": policy, "seed": seed, "eval_seed": seed, "split": "rl_valid", "samples": 2,
            "questions": QUESTIONS, "correct_count_Q": [max(0, c - 1) for c in content], "formed_count_Q": [1, 1],
            "calls_Q": [2, 2], "content_count_Q": content,
            "config": {"rl": {"algorithm": algorithm, "optim": {"lr": 1e-5}, "trainer": {"total_steps": 8}}}}


def family(tmp_path: Path, format_seed3: list[int] = (1, 1)) -> lq.Family:
    """4 seeds: SFT and the format-only arm answer 2 of 4 right in content (0.5) on every seed, GRPO 0.75, 0.75,
    0.75 and 1.0 (seed 3: [2, 2])."""
    grpo = {0: [2, 1], 1: [2, 1], 2: [1, 2], 3: [2, 2]}
    runs = [result("sft", s, [1, 1]) for s in range(4)] + [result("grpo", s, grpo[s]) for s in range(4)]
    runs += [result("format", s, [1, 1] if s < 3 else list(format_seed3)) for s in range(4)]
    lq.write_per_question("learning-valid-v2", {"arith": lq.family_payload(runs)}, root=tmp_path)
    return lq.read_per_question("learning-valid-v2", tmp_path)["arith"]


def test_the_content_counts_round_trip_and_a_v1_file_has_none(tmp_path: Path) -> None:
    f = family(tmp_path)
    assert lc.has_content(f) and f.runs["grpo-s3"].content.tolist() == [2, 2]
    v1 = lq.read_per_question("learning")["arith"]       # the committed v1 record: graded before content existed
    assert not lc.has_content(v1) and v1.runs["grpo-s0"].content is None


def test_the_primary_is_grpo_task_minus_format_only_by_seed(tmp_path: Path) -> None:
    f = family(tmp_path)
    rows = {row[0]: row for row in lc.content_table(f, ("grpo", "arpo", "aepo"), "grpo", 0.05, 0.8, 0.07)["rows"]}
    assert list(rows) == ["content: grpo - format", "content: grpo - sft"]
    # d per seed 0.25, 0.25, 0.25, 0.5: mean 0.3125, sd 0.125, se 0.0625, t 5.0 on 3 df: p 0.0154; 95% interval
    # 0.3125 -/+ 3.1824 x 0.0625 = [0.114, 0.511]; MDE (3.1824 + 0.9785) x 0.0625 = 0.260
    primary = rows["content: grpo - format"]
    assert primary[1:8] == ["primary", "rl_valid", "4 x 2", "+0.312", "[+0.114, +0.511]", "0.015", "0.260"]
    assert primary[-1] == "shown"
    seeds = int(primary[8])           # the fewest seeds whose MDE at sd 0.125 is <= 0.07
    assert st.t_mde(0.125, seeds) <= 0.07 < st.t_mde(0.125, seeds - 1)
    assert rows["content: grpo - sft"][1] == "secondary" and rows["content: grpo - sft"][-1] == \
        "shown (secondary, unadjusted)"
    lines = lc.content_verdicts(f, ("grpo",), "grpo", 0.05, 0.8, 0.07)
    assert lines[0] == "content: grpo - format: +0.312 [+0.114, +0.511], seed-level t-test p 0.015 -> shown"


def test_content_accuracy_stands_beside_the_format_strict_one(tmp_path: Path) -> None:
    rows = {row[0]: row for row in lc.accuracy_table(family(tmp_path))["rows"]}
    # grpo: content 13 of 16 answers (0.8125); format-strict one fewer per question where content > 0: 5 of 16
    assert rows["grpo"][1:] == ["0, 1, 2, 3", "0.812", "0.312", "0.500"]
    assert rows["sft"][2:4] == ["0.500", "0.000"]


def test_the_protocol_tables_carry_v2_where_the_runs_have_content(tmp_path: Path) -> None:
    tables = lp.protocol_tables({"arith": family(tmp_path)}, lp.design_for("rl_valid"))
    assert {"arith-content", "arith-content-policies", "arith-verdicts"} <= set(tables)
    assert tables["arith-verdicts"]["rows"][0][0].startswith("content: grpo - format: +0.312")
    assert "arith-content" not in lp.protocol_tables(lq.read_per_question("learning"), lp.design_for("eval_test"))


def test_the_pilot_rule_no_collapse_clip_active_then_the_smallest_sd() -> None:
    settings = [lc.PilotSetting("b8-lr3e-5", 8, 1, True, 0.01),    # a collapse: out
                lc.PilotSetting("b8-lr1e-6", 8, 0, False, 0.02),   # the clip fraction at zero: out
                lc.PilotSetting("b8-lr1e-5", 8, 0, True, 0.05),
                lc.PilotSetting("b16-lr1e-5", 8, 0, True, 0.03)]   # the smallest sd of those left
    assert lc.choose_setting(settings).name == "b16-lr1e-5"
    assert lc.choose_setting(settings[:2]) is None


def test_a_collapse_is_an_alarm_in_training_or_content_below_sfts_on_its_seed(tmp_path: Path) -> None:
    f = family(tmp_path, format_seed3=[0, 1])   # the format-only arm's seed 3: 1 of 4 (0.25) < SFT's 0.5
    steps = {"columns": ["algorithm", "seed", "step", "clip frac", "alarms"],
             "rows": [["grpo", 0, 1, 0.01, ""], ["grpo", 0, 2, 0.0, "formed_but_wrong"],
                      ["format", 1, 1, 0.02, "no_signal_groups"], ["format", 1, 2, None, ""]]}
    # grpo seed 0: formed_but_wrong is a collapse alarm; format seed 1: no_signal_groups is not; format seed 3:
    # content below SFT's same seed
    assert lc.collapsed_runs(steps, f) == {("grpo", 0), ("format", 3)}
    # clip fraction above 0 in 2 of the 3 steps that have one (None left out): at least half
    assert lc.clip_active(steps)
    assert not lc.clip_active({"columns": ["clip frac"], "rows": [[0.0], [0.0], [0.01]]})
    pilot = lc.pilot_setting("b8", steps, f, "grpo")
    # d per seed 0.25, 0.25, 0.25, 0.75: sd sqrt((3 x 0.125^2 + 0.375^2) / 3) = 0.25
    assert (pilot.runs, pilot.collapsed, pilot.clip_active) == (8, 2, True)
    assert pilot.content_sd == pytest.approx(0.25)


def test_the_pilot_cli_reads_records_and_prints_the_choice(tmp_path: Path, monkeypatch, capsys) -> None:
    import json

    import bench.results

    f = family(tmp_path)  # its per-question file: tmp_path/learning-valid-v2.json
    steps = {"columns": ["algorithm", "seed", "step", "clip frac", "alarms"], "rows": [["grpo", 0, 1, 0.01, ""]]}
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "learning-valid-v2.json").write_text(json.dumps({"tables": {"arith-steps": steps}}))
    monkeypatch.setattr(bench.results, "RESULTS_DIR", tmp_path / "records")
    monkeypatch.setattr(lc, "read_per_question", lambda name: lq.read_per_question(name, tmp_path))
    assert lc.main(["learning-valid-v2"]) == 0
    out = capsys.readouterr().out
    # no alarm, no run below SFT, the clip fraction above zero in 1 of 1 steps; sd 0.125 (the primary's fixture)
    assert "learning-valid-v2: 8 runs, 0 collapsed, clip fraction above zero, per-seed sd of the primary 0.1250" in out
    assert out.strip().endswith("chosen: learning-valid-v2") and lc.has_content(f)


def test_under_v2_the_format_strict_endpoints_are_exploratory(tmp_path: Path) -> None:
    # the primary family's confirmatory design (eval_test), but the runs were graded for content: v1's E1 / E2 are
    # read beside v2's primary, unadjusted, never as its claims
    tables = lp.protocol_tables({"arith": family(tmp_path)}, lp.design_for("eval_test"))
    assert all(row[6] == "unadjusted (exploratory)" and row[-1].endswith("(exploratory, unadjusted)")
               for row in tables["arith-primary"]["rows"])
    assert tables["arith-content"]["rows"][0][-1] == "shown"
