"""bench/bench_learning.py: its config overlay validates, and the statistics behind its verdicts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from bench import learning_stats as st
from bench.learning_jobs import Job
from stages.core.config.eval import HeldoutSection
from stages.core.env import PROJECT_ROOT
from stages.heldout import summarize_verdicts

BENCH = PROJECT_ROOT / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _module("learning_report")


bench = _module("bench_learning")


@pytest.mark.parametrize("algo", ["grpo", "arpo", "aepo"])
@pytest.mark.parametrize("family", ["arith", "chain"])
def test_learning_config_validates_for_every_family_and_algorithm(family: str, algo: str) -> None:
    args = bench.parse_args(["--backend", "transformers"])
    cfg = bench.load(args, family, algo)
    assert cfg.rl.algorithm == algo and cfg.rl.rollout.n == 8 and cfg.rl.rollout.backend == "transformers"
    syn = cfg.data.synthetic
    assert syn.n_math == syn.n_qa == 0 and (syn.n_arith, syn.n_chain) == ((800, 0) if family == "arith" else (0, 800))
    # 400 test questions (the confirmatory run), 80 validation questions (every choice of a setting)
    assert (round(800 * syn.test_fraction), round(800 * syn.valid_fraction)) == (400, 80)
    prompt = "tir_python_short" if family == "arith" else "tir_search_python_short"
    assert cfg.agent.prompt_template == cfg.data.system_prompt == prompt
    # the same rollout budget whatever the algorithm; the response budget is the family's
    assert (cfg.rl.trainer.train_batch_size, cfg.rl.trainer.total_steps) == (2, 8 if family == "arith" else 3)
    # each family's step size, chosen on its own validation split (records learning-valid-lr3e-5, -chain-lr1e-5)
    assert cfg.rl.optim.lr == (3e-5 if family == "arith" else 1e-5)
    assert cfg.rl.rollout.max_response_length == (160 if family == "arith" else 256)
    spec = bench.heldout_spec(args, cfg, 3)
    assert spec.call_limit == cfg.rl.rollout.call_limit and spec.split == "eval_test"
    # a run's own seed is its evaluation's sampling seed: no two runs share their evaluation noise
    assert spec.seed == 3 and spec.samples == args.samples == 1


def test_the_design_pairs_sft_seeds_with_runs_and_adds_the_lr_zero_control() -> None:
    args = bench.parse_args(["--backend", "transformers", "--families", "arith", "--seeds", "0,1",
                             "--algos", "grpo,arpo", "--no-sft-steps"])
    jobs, baselines = bench.job_lists(args, ["arith"])
    assert list(map(str, jobs)) == ["arith/sft:0", "arith/sft:1", "arith/grpo:0", "arith/arpo:0", "arith/grpo:1",
                                    "arith/arpo:1", "arith/control:0"] and baselines == []
    control = bench.load(args, "arith", "control")
    assert control.rl.algorithm == "grpo" and control.rl.optim.lr == 0
    assert bench.load(args, "arith", "arpo").rl.optim.lr > 0


def test_results_live_apart_per_split_and_tag_with_sft_shared_by_tags(tmp_path: Path) -> None:
    def path(root: Path, job: str, *rest) -> Path:
        return bench.result_path(root, Job.parse(job), *rest)

    assert path(tmp_path, "arith/grpo:1") == tmp_path / "results" / "arith" / "grpo-s1.json"
    assert path(tmp_path, "arith/grpo:1", "lr1e-5", "rl_valid") == tmp_path / "results/arith-valid@lr1e-5/grpo-s1.json"
    assert path(tmp_path, "arith/sft:0", "lr1e-5", "rl_valid") == tmp_path / "results/arith-valid/sft-s0.json"
    assert path(tmp_path, "arith/sftsteps:0", "x", "rl_valid") == tmp_path / "results/arith/sftsteps-s0.json"
    # a tag that changes SFT has SFT evaluations of its own
    assert path(tmp_path, "arith/sft:0", "sft48", "rl_valid", True) == tmp_path / "results/arith-valid@sft48/sft-s0.json"
    changes = bench.parse_args(["-o", "sft.max_steps=48", "-o", "rl.optim.lr=1e-5"])
    assert bench.changes_sft(changes) and not bench.changes_sft(bench.parse_args(["-o", "rl.optim.lr=1e-5"]))
    assert bench.job_lists(bench.parse_args(["--algos", "", "--seeds", "0", "--control-seeds", ""]),
                           ["arith"])[0] == [Job("arith", "sft", 0)]


def test_two_level_interval_holds_the_seed_spread() -> None:
    # same questions: a perfect vs a useless algorithm, every seed alike -> every draw gives +1
    assert st.unpaired_two_level_diff(np.ones((5, 3)), np.zeros((5, 2))) == pytest.approx((1.0, 1.0, 1.0))
    # a: seed 0 right everywhere, seed 1 wrong everywhere; b: 0.5 everywhere. Mean difference 0; a draw of a's
    # seeds is {0,0} (+0.5), {1,1} (-0.5) or mixed (0), each extreme with probability 1/4 -> interval [-0.5, 0.5]
    a = np.array([[1.0, 0.0]] * 4)
    diff, low, high = st.unpaired_two_level_diff(a, np.full((4, 2), 0.5))
    assert diff == pytest.approx(0.0) and low == pytest.approx(-0.5) and high == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same questions"):
        st.unpaired_two_level_diff(np.ones((3, 2)), np.ones((4, 2)))


def test_paired_gain_is_exact_when_every_question_moves_the_same_way() -> None:
    # every question gains exactly 0.5: each bootstrap mean is 0.5, so the interval collapses to it
    assert st.paired_gain([0.0, 0.5, 0.25], [0.5, 1.0, 0.75]) == pytest.approx((0.5, 0.5, 0.5))


def test_paired_gain_interval_covers_the_mean_and_rejects_mismatched_questions() -> None:
    sft = [0, 0, 1, 1, 0, 1, 0, 0]
    rl = [1, 0, 1, 1, 1, 1, 0, 1]   # 3 questions gained, none lost: mean gain 3/8
    mean, low, high = st.paired_gain(sft, rl, samples=4000)
    assert mean == pytest.approx(0.375) and 0.0 <= low < mean < high <= 0.875
    with pytest.raises(ValueError, match="same questions"):
        st.paired_gain([1, 0], [1])


def test_spread_and_early_late() -> None:
    assert report.spread([0.5, 0.7, 0.6]) == pytest.approx({"mean": 0.6, "min": 0.5, "max": 0.7, "range": 0.2})
    rows = [{"step": i, "r": float(i)} for i in range(1, 8)]   # first 3 mean 2, last 3 mean 6
    assert report.early_late(rows, "r") == (2.0, 6.0)
    # a 3-step run: step 1 vs step 3 (not the same 3-step window twice); 4 steps: 1-2 vs 3-4; 1 step: itself
    assert report.early_late(rows[:3], "r") == (1.0, 3.0)
    assert report.early_late(rows[:4], "r") == (1.5, 3.5)
    assert report.early_late(rows[:1], "r") == (1.0, 1.0)


def _run(algo: str, seed: int, correct: list[float], tools: float, alarms: list | None = None) -> dict:
    steps = [{"step": s, "reward/mean": 0.1 * s, "accuracy": 0.1 * s, "tools/calls_per_traj": 1.0,
              "rollout/tool_calls_executed_per_traj": tools, "rollout/branches_per_group": 2.0 if algo != "grpo"
              else 0.0, "entropy/mean": 0.05, "reward/groups_without_signal": 0.5, "timing/step_s": 60.0,
              "reward/format_error_rate": 0.1, "response/length": 90.0}
             for s in range(1, 7)]
    acc = float(np.mean(correct))
    return {"algorithm": algo, "seed": seed, "correct_Q": correct, "steps": steps, "alarms": alarms or [],
            "questions": [f"q{i}" for i in range(len(correct))],
            "advantage_signs": {"agreement": 1.0, "trajectories": 8.0},
            "heldout": {"accuracy": acc, "ci_low": acc - 0.1, "ci_high": acc + 0.1, "tool_calls_per_traj": tools,
                        "format_valid": 1.0}}


def test_verdicts_say_plainly_whether_rl_beats_sft_and_judge_both_claims() -> None:
    sft = _run("sft", 0, [0.0] * 10 + [1.0] * 10, 1.0)
    floor = {"name": "reward_at_floor", "step": 3, "message": "mean reward -1.00 for 3 steps"}
    runs = {"grpo": [_run("grpo", s, [1.0] * 19 + [0.0], 1.0) for s in (0, 1)],          # 0.95 both seeds
            "arpo": [_run("arpo", 0, [0.0] * 10 + [1.0] * 10, 0.5, [floor]), _run("arpo", 1, [1.0] * 20, 0.5)]}
    summaries = {algo: report.algorithm_summary(r, sft) for algo, r in runs.items()}
    # GRPO: 9 of 10 wrong questions fixed, 1 right one lost -> gain 0.45 > seed range 0
    assert summaries["grpo"]["gain"]["mean"] == pytest.approx(0.45)
    lines = report.verdicts(summaries, sft, runs)
    # per question GRPO - SFT: ten +1, nine 0, one -1 (mean 0.45, sd 0.59, standard error 0.13): the interval over
    # questions (both seeds alike) is about 0.45 +- 0.26, above 0
    assert lines[0].startswith("grpo: mean gain over SFT +0.450") and lines[0].endswith("-> above SFT")
    assert "RL beats SFT beyond the seed-to-seed spread" in lines[1]
    # ARPO: seed 0 unchanged (gain 0 on every question), seed 1 perfect: a quarter of the draws take seed 0 twice
    # and give exactly 0, so the interval's low end is 0; mean 0.25 < seed range 0.5
    assert lines[2].startswith("arpo: mean gain over SFT +0.250, 95% interval over questions and seeds [+0.000,")
    assert lines[2].endswith("not distinguishable from SFT (the interval holds 0)")
    assert "not distinguishable" in lines[3]
    assert lines[4].startswith("sanity: advantage sign") and "grpo 100%" in lines[4]
    # ARPO 0.75 vs GRPO 0.95 -> -0.200; a draw of ARPO's seeds {0, 0} gives 0.5 - 0.95, {1, 1} gives +0.05
    assert "claim 1" in lines[5] and "ARPO - GRPO -0.200" in lines[5] and "not distinguishable at this scale" in lines[5]
    assert "claim 2" in lines[6] and "ARPO 0.50 vs GRPO 1.00 (0.50x" in lines[6] and "about half in training" in lines[6]
    assert lines[7] == "collapse: arpo seed 0 -- alarm reward_at_floor at step 3: mean reward -1.00 for 3 steps"
    table = report.table_rows(summaries, sft)
    assert [r["policy"] for r in table] == ["SFT", "grpo (2 seeds)", "arpo (2 seeds)"]
    assert table[1]["reward early -> late"] == "0.20 -> 0.50"          # steps 1-3 vs 4-6 of 0.1 * step
    assert table[2]["runs with alarms"] == "reward_at_floor 1/2"
    assert table[1]["mean gain [95%]"].startswith("+0.450 [")
    claims = report.claims_table(runs)                                # the same two claims, as the record's table
    assert [row[0] for row in claims["rows"]] == ["arpo - grpo"]
    assert claims["rows"][0][1].startswith("-0.200 [") and claims["rows"][0][2] == "within noise"
    assert claims["rows"][0][3:] == ["0.50 vs 1.00 (0.50x)", "0.50 vs 1.00 (0.50x)"]


def test_step_tables_line_up_each_step_with_the_sft_policy_on_its_prompts() -> None:
    runs = {"grpo": [_run("grpo", s, [1.0], 1.0) for s in (0, 1)]}
    runs["grpo"][0]["alarms"] = [{"name": "sampler_drift", "step": 2, "message": "m"}]
    steps = report.step_table(runs["grpo"])
    assert len(steps["rows"]) == 12 and steps["columns"][:4] == ["algorithm", "seed", "step", "reward"]
    assert steps["rows"][1][:4] == ["grpo", 0, 2, 0.2] and steps["rows"][1][-1] == "sampler_drift"
    # SFT on step 1's prompts: reward -0.5 (seed 0) and -0.3 (seed 1) -> -0.4; GRPO's step 1 is 0.1 for both seeds
    baselines = [{"seed": seed, "steps": [{"step": 1, "reward/mean": r, "reward/format_error_rate": 0.5}]}
                 for seed, r in ((0, -0.5), (1, -0.3))]
    table = report.steps_against_sft(runs, baselines)
    assert table["columns"] == ["step", "SFT reward", "grpo reward", "SFT format err", "grpo format err"]
    assert table["rows"] == [[1, -0.4, 0.1, 0.5, 0.1]]


def test_advantage_sign_agreement_flags_a_flipped_sign() -> None:
    def row(step, group, score, adv):
        return {"step": step, "group": group, "reward": {"score": score}, "advantage": adv}

    # group (1, 0): mean 0, +1 gets a positive and -1 a negative advantage; the 0 at the mean is left out;
    # group (1, 1) has no signal (all -1) and is skipped; group (2, 0) has its sign flipped on both members
    rows = [row(1, 0, 1.0, 0.9), row(1, 0, -1.0, -0.9), row(1, 0, 0.0, 0.0),
            row(1, 1, -1.0, 0.0), row(1, 1, -1.0, 0.0),
            row(2, 0, 1.0, -0.7), row(2, 0, 0.0, 0.7)]
    assert report.advantage_sign_agreement(rows) == {"agreement": 0.5, "trajectories": 4.0}


def test_plot_writes_a_png(tmp_path: Path) -> None:
    sft = _run("sft", 0, [0.0, 1.0], 1.0)
    results = {"sft": sft, "grpo:0": _run("grpo", 0, [1.0, 1.0], 1.0), "arpo:0": _run("arpo", 0, [0.0, 1.0], 0.5)}
    png = report.plot(results, sft, tmp_path / "learning.png", "arith")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heldout_accuracy_is_the_mean_of_per_question_fractions() -> None:
    # 3 questions x 2 samples: fractions 1, 0.5, 0 -> accuracy 0.5; every bootstrap mean lies in [0, 1]
    out = summarize_verdicts(np.array([[1, 1], [1, 0], [0, 0]]), HeldoutSection(bootstrap_samples=500))
    assert out["accuracy"] == pytest.approx(0.5) and 0.0 <= out["ci_low"] < 0.5 < out["ci_high"] <= 1.0
    same = summarize_verdicts(np.ones((4, 1)), HeldoutSection(bootstrap_samples=500))
    assert (same["accuracy"], same["ci_low"], same["ci_high"]) == (1.0, 1.0, 1.0)


def test_stage_gain_rows_show_each_stage_change_from_the_one_before() -> None:
    from stages.core.refs import ScoresRef
    from stages.eval.report import render_gains, stage_gain_rows

    def ref(acc: float, low: float, high: float) -> ScoresRef:
        return ScoresRef(path="x", fingerprint=str(acc), benchmark="eval_test",
                         meta={"accuracy": acc, "ci_low": low, "ci_high": high, "format_valid": acc + 0.1,
                               "tool_calls_per_traj": 1.0, "questions": 8, "samples": 1, "temperature": 0.0})

    gains = {"base": ref(0.0, 0.0, 0.0), "sft": ref(0.25, 0.0, 0.5), "rl": ref(0.375, 0.125, 0.625)}
    rows = stage_gain_rows(gains)
    # change = accuracy minus the row above, in points: SFT 25 - 0 = 25; RL 37.5 - 25 = 12.5
    assert [r["policy"] for r in rows] == ["base", "sft", "rl"]
    assert [r["change"] for r in rows] == [None, 25.0, 12.5]
    assert rows[2]["ci"] == "[12.5, 62.5]" and rows[1]["format valid"] == 35.0
    text = "\n".join(render_gains(gains, 0.95))
    assert "What each stage bought" in text and "| rl " in text and "12.5" in text
    assert render_gains({}, 0.95) == []


def test_failure_breakdown_names_the_first_cause_and_counts_cut_answers(tmp_path):
    failures = _module("learning_failures")
    assert failures.failure_cause("<python>x</python> <result>1</result> think", 256, 256) == "cut at cap"
    assert failures.failure_cause("The answer is 3.", 40, 256) == "no <answer>"
    assert failures.failure_cause("<answer> 3 </answer>", 40, 256) == "answer without boxed"
    assert failures.failure_cause("<answer> \\boxed{3}", 40, 256) == "answer not closed"
    predictions = tmp_path / "heldout" / "predictions.jsonl"
    predictions.parent.mkdir()
    predictions.write_text('{"responses": ["<answer> \\\\boxed{3} </answer>", "no tags at all", "cut"], '
                           '"length": [20, 30, 160], "format_ok": [true, false, false], "tool_calls": [2, 0, 4]}\n')
    result = tmp_path / "grpo-s0.json"
    result.write_text(json.dumps({"config": {"rl": {"rollout": {"max_response_length": 160}}},
                                  "heldout_path": str(predictions.with_name("summary.json"))}))
    shares = failures.breakdown(result)
    assert shares["answers"] == 3 and shares["format errors"] == pytest.approx(2 / 3)
    assert shares["no <answer>"] == shares["cut at cap"] == shares["cut (any)"] == pytest.approx(1 / 3)
    assert shares["0 calls"] == shares["2 calls"] == shares["3+ calls"] == pytest.approx(1 / 3)


def test_a_run_is_paired_with_the_sft_evaluation_of_its_own_sampling_seed() -> None:
    # SFT seed 0 gets 1 of 4 questions, seed 1 all 4 (mean over seeds 0.625); an lr = 0 control evaluated with
    # seed 0 answers exactly as SFT's seed 0 did: paired with it the gain is exactly 0, where against SFT's mean over
    # seeds it would read -0.375
    seeds = {0: [0.0, 0.0, 0.0, 1.0], 1: [1.0, 1.0, 1.0, 1.0]}
    sft = {**_run("sft", 0, [0.5, 0.5, 0.5, 1.0], 1.0), "correct_Q_by_seed": seeds}
    control = {**_run("control", 0, seeds[0], 1.0), "eval_seed": 0}
    summary = report.algorithm_summary([control], sft)
    assert summary["gain"]["mean"] == 0.0 and summary["gain_ci"] == [(0.0, 0.0)]
    assert summary["mean_gain"] == {"mean": 0.0, "low": 0.0, "high": 0.0}
    unpaired = report.algorithm_summary([control], {k: v for k, v in sft.items() if k != "correct_Q_by_seed"})
    assert unpaired["gain"]["mean"] == pytest.approx(-0.375)


# ---- issue 54: jobs as values, the format-only arm, content counts, no copy of the trainer's batch loop --------
def test_a_job_has_one_text_form_read_back_in_one_place() -> None:
    job = Job.parse("arith/format:3")
    assert job == Job("arith", "format", 3) and str(job) == "arith/format:3" and job.run == "format:3"
    assert job.trains and not Job("arith", "sftsteps", 0).trains and job.log_name("v2") == "arith-format-s3@v2"
    for bad in ("arith/grpo", "grpo:0", "arith/grpo:x", "/grpo:0"):
        with pytest.raises(ValueError, match="<family>/<kind>:<seed>"):
            Job.parse(bad)


def test_the_format_only_arm_is_grpo_under_the_format_reward() -> None:
    args = bench.parse_args(["--backend", "transformers", "--families", "arith", "--seeds", "0", "--algos", "grpo",
                             "--control-seeds", "", "--format-seeds", "0,1", "--no-sft-steps"])
    jobs, _ = bench.job_lists(args, ["arith"])
    assert list(map(str, jobs)) == ["arith/sft:0", "arith/grpo:0", "arith/format:0", "arith/format:1"]
    arm, task = bench.load(args, "arith", "format"), bench.load(args, "arith", "grpo")
    assert (arm.rl.algorithm, arm.rl.trainer.reward) == ("grpo", "format_only")
    assert task.rl.trainer.reward != "format_only" and arm.rl.optim.lr == task.rl.optim.lr
    assert bench.result_path(Path("/r"), Job("arith", "format", 1), "v2") == Path("/r/results/arith@v2/format-s1.json")


def test_a_questions_content_verdicts_grade_every_response_wherever_it_answers() -> None:
    # "What is 347 * 812?" (281764): an unclosed answer (right), a missing EOS (the first answer right), a wrong one
    right = "<think>347 * 812</think><python>print(347 * 812)</python> <result>\n281764\n</result>"
    prediction = {"answer": "281764", "ability": "math", "responses": [
        right + "<answer>\\boxed{281764}", right + "<answer>\\boxed{281764}</answer><answer>\\boxed{1}</answer>",
        right + "<answer>\\boxed{281765}</answer>"]}
    assert bench.content_verdicts(prediction) == [True, True, False]


def test_the_sft_baseline_takes_each_steps_prompts_from_the_trainers_own_function() -> None:
    import ast

    from stages.rl.trainer import epoch_order, step_batch

    # 10 rows, 3 per step: 3 steps per epoch; steps 0-2 are the first 9 of epoch 0's order, step 3 starts epoch 1
    per_epoch, order = 3, epoch_order(10, 7, 0)
    assert [step_batch(10, 7, s, per_epoch, 3)[0] for s in range(3)] == [order[0:3], order[3:6], order[6:9]]
    assert step_batch(10, 7, 3, per_epoch, 3) == (epoch_order(10, 7, 1)[0:3], 1, 0)
    # bench/learning_baseline.py calls it (the trainer's batch_rows does too): no copy of the loop to drift apart
    tree = ast.parse((BENCH / "learning_baseline.py").read_text())
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "step_batch" in called and "epoch_order" not in called and "divmod" not in called
