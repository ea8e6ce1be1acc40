"""Collapse alarms on synthetic metric streams: hand-made sequences where the step each alarm must fire (and the
steps it must not) follows from the thresholds in the comments."""

from __future__ import annotations

import json
import math

import pytest

from stages.core.config.rl import AlarmSection
from stages.core.errors import DeterministicError
from stages.rl.alarms import AlarmStop, AlarmWatch, alarms_markdown, detect_alarms

RULES = AlarmSection()  # defaults: tool 0.1x of a peak >= 0.5, entropy 0.1x / 1e-3, rise 0.3, window 3, ...


def stream(**columns: list[float]) -> list[dict]:
    """Rows step 1..n from per-metric columns, plus neutral values for the metrics not given."""
    n = len(next(iter(columns.values())))
    neutral = {"reward/mean": 0.0, "tools/calls_per_traj": 1.0, "entropy/mean": 0.3,
               "reward/format_error_rate": 0.2, "reward/groups_without_signal": 0.0, "loss": 0.1, "grad_norm": 1.0}
    return [{"step": i + 1, **neutral, **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def fired(rows: list[dict], rules: AlarmSection = RULES) -> dict[int, list[str]]:
    """{step: alarm names} from checking every prefix, as the trainer does after each step."""
    out = {}
    for i in range(len(rows)):
        names = [a.name for a in detect_alarms(rows[: i + 1], rules)]
        if names:
            out[rows[i]["step"]] = names
    return out


def test_a_healthy_run_raises_nothing():
    rows = stream(**{"reward/mean": [-0.8, -0.6, -0.5, -0.3, -0.2, 0.0, 0.1, 0.2],
                     "tools/calls_per_traj": [1.0, 1.1, 0.9, 1.2, 1.0, 1.3, 1.1, 1.2],
                     "entropy/mean": [0.30, 0.29, 0.28, 0.28, 0.27, 0.26, 0.26, 0.25],
                     "reward/format_error_rate": [0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.2],
                     "reward/groups_without_signal": [0.5, 0.5, 0.0, 0.5, 0.5, 0.0, 0.5, 0.5]})
    assert fired(rows) == {}


def test_tool_calls_falling_to_zero():
    # peak 1.2; 0.8 is above 0.1 * 1.2 = 0.12, 0.1 is below it -> step 4 only (step 5: 0.0 < 0.12 again)
    rows = stream(**{"tools/calls_per_traj": [1.2, 1.0, 0.8, 0.1, 0.0]})
    assert fired(rows) == {4: ["tool_collapse"], 5: ["tool_collapse"]}
    # a policy that never used its tools (peak 0.2 < tool_min_peak 0.5) has nothing to collapse from
    assert fired(stream(**{"tools/calls_per_traj": [0.2, 0.0, 0.0]})) == {}


def test_no_tool_call_at_step_1_of_a_tools_profile():
    # step 1 of a prompt offering 2 tools, no call: fires at once (tool_collapse needs an earlier peak); later
    # zero steps fall to the peak rule (a best of 0 < tool_min_peak: quiet)
    rows = stream(**{"tools/calls_per_traj": [0.0, 0.0, 0.0], "tools/offered": [2.0, 2.0, 2.0]})
    alarms = detect_alarms(rows[:1], RULES)
    assert [(a.name, a.step) for a in alarms] == [("tool_unused", 1)]
    assert "no tool call at the first step" in alarms[0].message and "offers 2 tool(s)" in alarms[0].message
    assert fired(rows) == {1: ["tool_unused"]}
    # a no-tool profile (the prompt offers none) and a step 1 with calls stay quiet
    assert fired(stream(**{"tools/calls_per_traj": [0.0, 0.0], "tools/offered": [0.0, 0.0]})) == {}
    assert fired(stream(**{"tools/calls_per_traj": [0.5, 0.6], "tools/offered": [2.0, 2.0]})) == {}


def test_entropy_collapse_relative_and_absolute():
    # 0.1 x the first step's 0.3 = 0.03: 0.031 passes, 0.029 fires
    assert fired(stream(**{"entropy/mean": [0.3, 0.031, 0.029]})) == {3: ["entropy_collapse"]}
    # below the absolute floor 1e-3 fires even on the first step
    assert fired(stream(**{"entropy/mean": [0.0005]})) == {1: ["entropy_collapse"]}


def test_format_errors_rising_over_a_window():
    # window 3. Step 6: last three average (0.3 + 0.5 + 0.6) / 3 = 0.467 < best earlier average 0.2 + 0.3 -> quiet.
    # Step 7: (0.5 + 0.6 + 0.7) / 3 = 0.6 >= 0.2 + 0.3 (earlier windows: 0.2 and 0.233) -> fires.
    rates = [0.2, 0.2, 0.2, 0.3, 0.5, 0.6, 0.7]
    assert fired(stream(**{"reward/format_error_rate": rates})) == {7: ["format_errors_rising"]}
    # fewer than 2 x window steps: no judgement yet, however high the rate
    assert fired(stream(**{"reward/format_error_rate": [0.0, 0.0, 0.9, 0.9, 0.9]})) == {}


def test_reward_flat_at_the_floor():
    # floor -1 +- 0.02 for 3 steps in a row: steps 1-2 are too few, step 3 fires; -0.9 breaks the run of steps
    assert fired(stream(**{"reward/mean": [-1.0, -1.0, -0.99]})) == {3: ["reward_at_floor"]}
    assert fired(stream(**{"reward/mean": [-1.0, -1.0, -0.9]})) == {}


def test_all_equal_reward_groups_dominating():
    # >= 80% of groups without signal for 3 steps: 0.8, 1.0, 0.9 fires at step 3; 0.5 in the middle does not
    assert fired(stream(**{"reward/groups_without_signal": [0.8, 1.0, 0.9]})) == {3: ["no_signal_groups"]}
    assert fired(stream(**{"reward/groups_without_signal": [0.8, 0.5, 1.0]})) == {}


def test_reward_collapse_and_several_alarms_in_one_step():
    # reward 0.5 -> -0.1 (< 0.5 - 0.5 = 0), tools 2.0 -> 0.1 (< 0.2), entropy 0.3 -> 0.02 (< 0.03): three alarms,
    # reported in the fixed CHECKS order
    rows = stream(**{"reward/mean": [0.5, -0.1], "tools/calls_per_traj": [2.0, 0.1], "entropy/mean": [0.3, 0.02]})
    assert fired(rows) == {2: ["tool_collapse", "entropy_collapse", "reward_collapse"]}


@pytest.mark.parametrize("key,value", [("loss", math.nan), ("grad_norm", math.inf), ("reward/mean", -math.inf)])
def test_nonfinite_values(key, value):
    rows = stream(**{key: [0.1, value]})
    assert "nonfinite_loss" in fired(rows)[2]


def test_sampler_drift_against_the_first_step():
    # the chain bench with the old refresh (a stale tied head), the environment's EOS left out: 4.0e-6 at step 1;
    # at step 2 2.3e-3 (lr 3e-5) and 1.9e-4 (lr 3e-6): >= 10x and > the floor 1e-4, both fire
    assert fired(stream(**{"rollout/logp_mismatch": [4.0e-6, 2.3e-3]})) == {2: ["sampler_drift"]}
    assert fired(stream(**{"rollout/logp_mismatch": [4.0e-6, 1.9e-4]})) == {2: ["sampler_drift"]}
    # bf16-like noise: 0.03 then 0.05 (1.7x < 10x) is quiet; fp32 jitter 4e-6 -> 9e-5 is 22x but under the floor 1e-4
    assert fired(stream(**{"rollout/logp_mismatch": [0.03, 0.05, 0.04]})) == {}
    assert fired(stream(**{"rollout/logp_mismatch": [4e-6, 9e-5]})) == {}
    # 10x the first step exactly fires (>=): 2e-3 -> 2e-2
    assert fired(stream(**{"rollout/logp_mismatch": [2e-3, 1e-2, 2e-2]})) == {3: ["sampler_drift"]}
    # above drift_max 0.5 fires at any step, the first included (two different models)
    assert fired(stream(**{"rollout/logp_mismatch": [0.7]})) == {1: ["sampler_drift"]}
    # a first step of 0 (a sampler sharing the trainer's tensors): anything over the floor fires
    assert fired(stream(**{"rollout/logp_mismatch": [0.0, 5e-5, 2e-4]})) == {3: ["sampler_drift"]}


def test_sampler_drift_stops_the_run_by_default(tmp_path, recorded):
    with pytest.raises(AlarmStop, match="sampler_drift.*not sampling from the policy"):
        AlarmWatch(RULES, tmp_path / "a.jsonl").check(stream(**{"rollout/logp_mismatch": [4.0e-6, 2.3e-3]}))


def test_disabled_alarms_stay_quiet():
    rows = stream(loss=[math.nan])
    assert fired(rows, AlarmSection(enabled=False)) == {}




def test_watch_flags_the_row_reports_and_warns_without_stopping(tmp_path, recorded):
    watch = AlarmWatch(RULES, tmp_path / "alarms.jsonl")
    rows = stream(**{"entropy/mean": [0.3, 0.02]})
    assert watch.check(rows[:1]) == [] and rows[0]["alarm"] == 0.0
    assert [a.name for a in watch.check(rows)] == ["entropy_collapse"]
    assert rows[1]["alarm"] == 1.0 and rows[1]["alarm/entropy_collapse"] == 1.0
    kinds = [(m["kind"], m.get("name") or m.get("key")) for m in recorded]
    assert kinds == [("event", "arpo.rl.alarm.entropy_collapse"), ("markdown", "rl-alarms")]
    assert recorded[0]["payload"] == {"name": "entropy_collapse", "step": 2, "stops_run": False,
                                      "message": recorded[0]["payload"]["message"]}
    assert "| 2 | **entropy_collapse** |" in recorded[1]["text"] and "| warn |" in recorded[1]["text"]
    assert [json.loads(line)["name"] for line in (tmp_path / "alarms.jsonl").read_text().splitlines()] == \
        ["entropy_collapse"]


def test_stop_on_raises_a_non_retried_error(tmp_path, recorded):
    # nonfinite_loss is in the default stop list; entropy_collapse stops only when asked for
    with pytest.raises(AlarmStop, match="nonfinite_loss.*rl.alarms.stop_on") as err:
        AlarmWatch(RULES, tmp_path / "a.jsonl").check(stream(loss=[math.nan]))
    assert isinstance(err.value, DeterministicError)
    assert recorded[-1]["kind"] == "markdown" and "| stop |" in recorded[-1]["text"]  # the alert is out first
    rules = AlarmSection(stop_on=("entropy_collapse",))
    with pytest.raises(AlarmStop, match="entropy_collapse"):
        AlarmWatch(rules, tmp_path / "b.jsonl").check(stream(**{"entropy/mean": [0.0]}))


def test_a_resumed_run_forgets_alarms_of_steps_it_redoes(tmp_path):
    path = tmp_path / "alarms.jsonl"
    path.write_text("".join(json.dumps({"name": "tool_collapse", "step": s, "message": "m"}) + "\n" for s in (2, 4)))
    assert [a.step for a in AlarmWatch(RULES, path, resumed_step=3).alarms] == [2]


def test_markdown_without_alarms():
    assert alarms_markdown([], RULES).startswith("## RL health: no alarm")


# ---- "well-formed but wrong": v1's learning record (bench/results/learning.json, table arith-steps) --------------
def _v1_steps() -> dict[tuple[str, int], list[dict]]:
    """Every RL run's per-step training metrics as the confirmatory run of the learning bench logged them (commit
    1ff76b7): reward, accuracy and format-error rate per step, one row per step, as the trainer's metrics rows."""
    from bench.results import RESULTS_DIR

    table = json.loads((RESULTS_DIR / "learning.json").read_text())["tables"]["arith-steps"]
    col = {name: i for i, name in enumerate(table["columns"])}
    runs: dict[tuple[str, int], list[dict]] = {}
    for row in table["rows"]:
        runs.setdefault((row[col["algorithm"]], row[col["seed"]]), []).append(
            {"step": row[col["step"]], "reward/mean": row[col["reward"]], "accuracy": row[col["acc"]],
             "reward/format_error_rate": row[col["format err"]]})
    return runs


def test_formed_but_wrong_names_arpo_seed_4_of_v1_which_reward_collapse_missed():
    run = _v1_steps()[("arpo", 4)]
    # ARPO seed 4, steps 5-8 (accuracy / format errors): 0.5 / 0.3125, 0.5625 / 0.1875, 0.3125 / 0.125,
    # 0.0625 / 0.0625; reward 0.1875, 0.375, 0.1875, 0.0. Steps with format errors <= 0.25: 6, 7, 8, whose accuracy
    # among well-formed answers is 0.5625 / 0.8125 = 0.692, 0.3125 / 0.875 = 0.357, 0.0625 / 0.9375 = 0.0667.
    # Step 7: 0.692 - 0.357 = 0.335 < 0.5, no alarm; step 8: 0.692 - 0.0667 = 0.626 > 0.5 -> formed_but_wrong.
    # reward_collapse never fires: the best reward 0.375 minus 0.0 is 0.375 < reward_drop 0.5.
    assert fired(run) == {8: ["formed_but_wrong"]}
    (alarm,) = detect_alarms(run, RULES)
    assert "well-formed but wrong" in alarm.message and "0.0667" in alarm.message and "step 6" in alarm.message


def test_formed_but_wrong_is_silent_on_v1s_other_runs():
    # every other run of v1 either had no step with format errors <= 0.25 after a better such step by 0.5, or none
    # at all (GRPO seed 2 and AEPO seed 3, which ended below SFT on the test split, kept format errors of 0.5 and
    # 0.25 with their accuracy among well-formed 0.5 and 0.75: the training stream does not show them)
    others = {key: fired(run) for key, run in _v1_steps().items() if key != ("arpo", 4)}
    assert {key: names for key, steps in others.items() for names in steps.values()
            if "formed_but_wrong" in names} == {}


def test_formed_but_wrong_compares_only_mostly_well_formed_steps():
    # step 1: format errors 0.9 (ratio 0.1 / 0.1 = 1.0, not compared: 0.9 > 0.25); steps 2-3 at 0.2: ratios
    # 0.6 / 0.8 = 0.75 and 0.16 / 0.8 = 0.2, a drop of 0.55 > 0.5 -> step 3
    rows = stream(**{"accuracy": [0.1, 0.6, 0.16], "reward/format_error_rate": [0.9, 0.2, 0.2]})
    assert fired(rows) == {3: ["formed_but_wrong"]}
    # the same fall at format errors 0.3 (> 0.25) is not a well-formed step: nothing
    rows = stream(**{"accuracy": [0.1, 0.6, 0.14], "reward/format_error_rate": [0.9, 0.2, 0.3]})
    assert fired(rows) == {}
