"""bench/learning_questions.py and bench/learning_protocol.py: the committed per-question counts round-trip, give a
record's headline figures, and the protocol's tables are recomputed from them alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import learning_protocol as lp
from bench import learning_questions as lq

QUESTIONS = ["q0", "q1", "q2", "q3"]


def result(algo: str, seed: int, correct: list[int], formed: list[int] | None = None, calls: list[int] | None = None,
           samples: int = 2, questions: list[str] = QUESTIONS, split: str = "eval_test") -> dict:
    """A worker's results file, as bench/bench_learning.py writes it (the fields compact_run reads)."""
    rl_algo = "grpo" if algo in ("sft", "control") else algo
    return {"algorithm": algo, "seed": seed, "eval_seed": seed, "split": split, "samples": samples,
            "questions": questions, "correct_count_Q": correct, "formed_count_Q": formed or [samples] * len(correct),
            "calls_Q": calls or [1] * len(correct),
            "config": {"rl": {"algorithm": rl_algo, "optim": {"lr": 0.0 if algo == "control" else 3e-6},
                              "trainer": {"total_steps": 6}}}}


def small_record(tmp_path: Path) -> dict[str, lq.Family]:
    runs = [result("sft", 0, [0, 1, 2, 1]), result("sft", 1, [1, 1, 0, 0]), result("grpo", 0, [2, 2, 2, 0]),
            result("grpo", 1, [1, 1, 1, 1]), result("control", 0, [0, 1, 2, 1])]
    lq.write_per_question("learning", {"arith": lq.family_payload(runs)}, root=tmp_path)
    return lq.read_per_question("learning", tmp_path)


def test_counts_are_one_base36_character_per_question() -> None:
    assert lq.encode([0, 9, 10, 35]) == "09az"
    assert lq.decode("09az").tolist() == [0, 9, 10, 35]
    with pytest.raises(ValueError, match="outside 0..35"):
        lq.encode([36])


def test_compact_run_reads_a_workers_results_file() -> None:
    run = lq.compact_run(result("arpo", 2, [0, 1, 2, 2], [1, 2, 2, 2], [0, 3, 12, 2]))
    assert run == {"policy": "arpo", "algorithm": "arpo", "seed": 2, "eval_seed": 2, "lr": 3e-6, "steps": 6,
                   "samples": 2, "correct": "0122", "formed": "1222", "calls": "03c2"}
    sft = lq.compact_run(result("sft", 0, [0, 0, 0, 0]))
    assert (sft["algorithm"], sft["lr"], sft["steps"]) == (None, 0.0, 0)   # the SFT policy had no RL
    assert lq.compact_run(result("control", 0, [0, 0, 0, 0]))["lr"] == 0.0


def test_runs_on_other_questions_or_twice_are_refused() -> None:
    with pytest.raises(ValueError, match="other questions"):
        lq.family_payload([result("sft", 0, [0] * 4), result("grpo", 0, [0] * 4, questions=["a", "b", "c", "d"])])
    with pytest.raises(ValueError, match="two runs are grpo-s0"):
        lq.family_payload([result("grpo", 0, [0] * 4), result("grpo", 0, [1] * 4)])


def test_the_file_is_json_with_one_run_per_line_and_round_trips(tmp_path: Path) -> None:
    families = small_record(tmp_path)
    text = (tmp_path / "learning.json").read_text()
    data = json.loads(text)
    assert data["record"] == "learning" and data["families"]["arith"]["questions"] == 4
    assert data["families"]["arith"]["questions_sha256"] == lq.questions_sha256(QUESTIONS)
    assert sum('"policy"' in line for line in text.splitlines()) == 5 == len(data["families"]["arith"]["runs"])
    arith = families["arith"]
    assert list(arith.runs) == ["sft-s0", "sft-s1", "grpo-s0", "grpo-s1", "control-s0"]
    assert arith.runs["grpo-s0"].correct.tolist() == [2, 2, 2, 0] and arith.split == "eval_test"
    # a second family written later keeps the first
    lq.write_per_question("learning", {"chain": lq.family_payload([result("sft", 0, [1, 1, 1, 1])])}, root=tmp_path)
    assert list(lq.read_per_question("learning", tmp_path)) == ["arith", "chain"]
    assert [p.name for p in tmp_path.iterdir()] == ["learning.json"]              # no temporary file left


def test_headline_figures_by_hand(tmp_path: Path) -> None:
    # samples 2. SFT: s0 (0, .5, 1, .5) mean .5, s1 (.5, .5, 0, 0) mean .25 -> .375. GRPO: s0 .75, s1 .5 -> .625,
    # gain per seed .75 - .5 = .25 and .5 - .25 = .25 -> .25. Control (seed 0 only): .5, paired with SFT seed 0: 0.0
    figures = lq.headline_figures(small_record(tmp_path))
    assert figures == {"arith_sft": 0.375, "arith_grpo": 0.625, "arith_grpo_gain": 0.25, "arith_control": 0.5,
                       "arith_control_gain": 0.0}


def test_verdicts() -> None:
    from bench.learning_stats import verdict

    assert verdict(0.1, True, 0.05, 0.07) == "shown"
    assert verdict(-0.1, True, 0.05, 0.07) == "reversed"
    assert verdict(0.01, False, 0.05, 0.07) == "not shown (the MDE was 0.050 <= 0.07)"
    assert verdict(0.01, False, 0.09, 0.07) == "within noise at an MDE of 0.090"


def synthetic(tmp_path: Path) -> dict[str, lq.Family]:
    """3 seeds x 60 questions, 1 sample: SFT right 30% of the time, GRPO and ARPO 90%, AEPO 10%; the control is SFT."""
    rng = np.random.default_rng(0)
    questions = [f"q{i}" for i in range(60)]
    rate = {"sft": 0.3, "grpo": 0.9, "arpo": 0.9, "aepo": 0.1}
    families = {}
    for family in ("arith", "chain"):
        runs = []
        for seed in range(3):
            draws = {algo: (rng.random(60) < p).astype(int).tolist() for algo, p in rate.items()}
            runs += [result(algo, seed, c, samples=1, questions=questions) for algo, c in draws.items()]
            runs.append(result("control", seed, draws["sft"], samples=1, questions=questions))
        families[family] = lq.family_payload(runs)
    lq.write_per_question("learning", families, root=tmp_path)
    return lq.read_per_question("learning", tmp_path)


def test_policy_table_pools_each_policys_seeds(tmp_path: Path) -> None:
    rows = {row[0]: row for row in lp.policy_table(small_record(tmp_path)["arith"])["rows"]}
    # sft: correct 4 + 2 = 6 of 16 samples; every sample well-formed; one call per question over 2 samples
    assert rows["sft"][1:] == ["0, 1", "2", "0.375", "1.000", "0.375", "0.50"]
    # grpo: 6 + 4 = 10 of 16; control (seed 0 only): 4 of 8
    assert rows["grpo"][3] == "0.625" and rows["control"][1:4] == ["0", "2", "0.500"]


def test_protocol_tables_from_the_per_question_file(tmp_path: Path) -> None:
    design = lp.Design(bootstrap_samples=1000)
    tables = lp.protocol_tables(synthetic(tmp_path), design)
    kinds = ("policies", "primary", "secondary", "control", "design", "verdicts")
    assert set(tables) == {f"{f}-{t}" for f in ("arith", "chain") for t in kinds}
    primary = {row[0]: row for row in tables["arith-primary"]["rows"]}
    assert list(primary) == ["E1 grpo - sft", "E1 arpo - sft", "E1 aepo - sft", "E2 arpo - grpo", "E3 aepo - grpo"]
    verdicts = {k: row[-1] for k, row in primary.items()}
    assert verdicts["E1 grpo - sft"] == verdicts["E1 arpo - sft"] == "shown"
    assert verdicts["E1 aepo - sft"] == verdicts["E3 aepo - grpo"] == "reversed"
    assert verdicts["E2 arpo - grpo"].startswith(("within noise", "not shown"))
    # Holm over 5 seed-level t-tests: the steps' intervals at 1 - 0.05/5 = 99%, 98.75%, 98.33%, 97.5%, and the last
    # (E2, the largest p) at 95%
    levels = sorted(row[4].rsplit("(", 1)[1] for row in primary.values())
    assert levels == ["95%)", "97.5%)", "98.33%)", "98.75%)", "99%)"] and "(95%)" in primary["E2 arpo - grpo"][4]
    chain = tables["chain-primary"]["rows"]
    assert all(row[6] == "unadjusted (exploratory)" and row[-1].endswith("(exploratory, unadjusted)") for row in chain)
    assert tables["arith-control"]["rows"][0][-1].startswith("holds 0")
    secondary = [row[0] for row in tables["arith-secondary"]["rows"]]
    assert secondary[:3] == ["accuracy among well-formed: grpo - sft", "well-formed rate: grpo - sft",
                             "tool calls per question: grpo vs sft"]
    assert "tool calls per question: arpo vs grpo" in secondary
    # rerunning from the committed file reproduces every cell
    assert lp.protocol_tables(lq.read_per_question("learning", tmp_path), design) == tables


def test_the_cli_prints_the_tables_and_refuses_a_missing_file(tmp_path: Path, capsys) -> None:
    small_record(tmp_path)
    assert lp.main(["learning", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## arith-primary" in out and "| E1 grpo - sft | eval_test | 2 x 4 | +0.250 |" in out
    assert lp.main(["nothing", "--root", str(tmp_path)]) == 2


def test_a_baseline_pilot_plans_the_comparisons_between_algorithms(tmp_path: Path) -> None:
    design = lp.Design(primary_family="", plan_as_primary="arith", bootstrap_samples=200)
    rows = lp.design_table("arith", small_record(tmp_path)["arith"], design)["rows"]
    assert [r[0] for r in rows] == ["E1 grpo - sft", "E2, E3 (planned: seed variance x2)"]
    # the comparison between two trained policies carries twice the baseline's seed variance
    assert float(rows[1][2]) == pytest.approx(2 * float(rows[0][2]), rel=1e-2)
    # planned at Holm's first step over the 5 primaries (0.05 / 5) though the pilot itself claims nothing
    assert "alpha 0.01" in lp.design_table("arith", small_record(tmp_path)["arith"], design)["columns"][5]
