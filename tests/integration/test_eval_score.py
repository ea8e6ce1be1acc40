"""The scoring and report stages end to end on hand-written predictions files, with the judge served on loopback:
hand-derived summaries, a cached re-score that sends no judge call, the report with published numbers, the
Prefect score task's cache (judge URL excluded, judge identity included), and runs against vLLM serving the
tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from prefect import flow

from stages.core.atomic import write_jsonl
from stages.core.config.eval import EvalSection, JudgeSection
from stages.core.refs import PredictionsRef
from stages.eval.report import build_report
from stages.eval.scoring import score_predictions
from tests.unit.test_eval_judge import FakeJudgeServer


def _row(benchmark: str, task_type: str, qid: str, sample: int, golds: list[str], prediction: str | None,
         output: str | None = None, python: int = 0, search: int = 0) -> dict:
    return {"id": qid, "benchmark": benchmark, "sample": sample, "question": f"question {qid}?", "golds": golds,
            "task_type": task_type, "prediction": prediction, "output": output if output is not None else
            f"<think>...</think><answer>\\boxed{{{prediction}}}</answer>", "finish_reason": "stop",
            "tool_calls": {"python": python, "search": search},
            "timing": {"llm_s": 1.0, "python_s": 0.0, "search_s": 0.0, "total_s": 2.0}, "timed_out": False,
            "error": None, "model": "tiny", "benchmark_hash": f"hash-{benchmark}"}


def _gaia(tmp_path: Path) -> PredictionsRef:
    """3 questions x 2 samples (QA). EM / F1 / judge per sample are derived in test_qa_scores_by_hand."""
    rows = [_row("gaia", "qa", "q1", 0, ["Frank Lowy"], "Frank Lowy", search=2),
            _row("gaia", "qa", "q1", 1, ["Frank Lowy"], "Sir Frank Lowy AC", search=1),
            _row("gaia", "qa", "q2", 0, ["NYC", "New York City"], "Boston", python=1),
            _row("gaia", "qa", "q2", 1, ["NYC", "New York City"], None, output="I think\nthe answer is new york city"),
            _row("gaia", "qa", "q3", 0, ["3"], "3"),
            _row("gaia", "qa", "q3", 1, ["3"], None, output="")]
    path = write_jsonl(tmp_path / "gaia" / "predictions.jsonl", rows)
    return PredictionsRef(path=str(path.parent), fingerprint="gaia-preds-1", benchmark="gaia")


def _aime(tmp_path: Path) -> PredictionsRef:
    rows = [_row("aime24", "math", "a1", 0, ["204"], "204"), _row("aime24", "math", "a1", 1, ["204"], "205"),
            _row("aime24", "math", "a2", 0, ["\\frac{1}{2}"], "0.5"),
            _row("aime24", "math", "a2", 1, ["\\frac{1}{2}"], "1/2")]
    path = write_jsonl(tmp_path / "aime24.jsonl", rows)
    return PredictionsRef(path=str(path), fingerprint="aime-preds-1", benchmark="aime24")


CFG = EvalSection(samples=5, pass_k=[1, 2, 5], judge=JudgeSection(concurrency=2), bootstrap_samples=200,
                  reference_setting="arpo-qwen3-14b", math_workers=1)


def test_qa_scores_by_hand_then_cached_rescore_makes_no_judge_call(tmp_path):
    preds = _gaia(tmp_path)
    with FakeJudgeServer() as server:
        scores = score_predictions(CFG, preds, server.endpoint(), tmp_path / "out", tmp_path / "cache")
        # q3 sample 1 has no text at all: nothing to judge, so 5 of 6 samples are sent
        assert len(server.requests) == 5
        s = scores.meta
        # llm_equal = EM OR judge: q1 [1 (EM), 1 (judge: contains "Frank Lowy")], q2 [0, 1 (fallback text
        # "I think\nthe answer is new york city" contains a gold)], q3 [1, 0] -> 4/6
        assert s["accuracy_metric"] == "llm_equal" and s["metrics"]["accuracy"]["value"] == pytest.approx(4 / 6)
        assert s["metrics"]["pass@1"]["value"] == pytest.approx(4 / 6)
        assert s["metrics"]["pass@2"]["value"] == pytest.approx(1.0)  # every question has one correct sample
        assert "pass@5" not in s["metrics"]  # only 2 samples per question were written (of eval.samples=5)
        assert s["em"] == pytest.approx(2 / 6)
        # F1: q1 [1, 2/3]; q2 [0, fallback "i think answer is new york city" vs "new york city": P 3/7, R 1 ->
        # 0.6]; q3 [1, 0] -> (1 + 2/3 + 0.6 + 1) / 6
        assert s["f1"] == pytest.approx((1 + 2 / 3 + 0.6 + 1) / 6)
        assert s["num_valid_answer"] == 4 and s["questions"] == 3 and s["samples_per_question"] == 2
        # judge vs rule (EM): agree on q1s0, q2s0, q3s0, q3s1; judge-only correct on q1s1 and q2s1
        assert s["judge_rule_agreement"] == pytest.approx(4 / 6)
        assert (s["judge_only_correct"], s["rule_only_correct"]) == (2, 0)
        # tools: 2 + 1 + 1 calls over 6 samples; 3 of 6 used a tool; productivity (2/3)(2/3)/(2/3 + 0.1)*100
        assert s["tool_calls"] == pytest.approx(4 / 6) and s["tool_use_rate"] == pytest.approx(0.5)
        assert s["tool_productivity"] == pytest.approx(12000 / 207)
        assert s["benchmark"] == "gaia" and s["benchmark_hash"] == "hash-gaia" and s["judge"] == "fake-judge@w1"

        samples = [json.loads(line) for line in (Path(scores.path) / "samples.jsonl").read_text().splitlines()]
        assert [x["llm_equal"] for x in samples] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]

        again = score_predictions(CFG, preds, server.endpoint(), tmp_path / "out", tmp_path / "cache", force=True)
        assert len(server.requests) == 5  # every verdict came from the SQLite cache
        assert again.meta["metrics"] == s["metrics"] and again.fingerprint != scores.fingerprint


def test_rule_only_scoring_uses_f1_and_em(tmp_path):
    cfg = CFG.model_copy(update={"judge": JudgeSection(enabled=False)})
    s = score_predictions(cfg, _gaia(tmp_path), None, tmp_path / "out", tmp_path / "cache").meta
    assert s["accuracy_metric"] == "f1" and s["judged"] is False and "llm_equal" not in s
    assert s["metrics"]["accuracy"]["value"] == pytest.approx((1 + 2 / 3 + 0.6 + 1) / 6)
    # EM decides pass@k: [[1, 0], [0, 0], [1, 0]] -> pass@1 2/6, pass@2 (1 + 0 + 1)/3
    assert s["metrics"]["pass@1"]["value"] == pytest.approx(2 / 6)
    assert s["metrics"]["pass@2"]["value"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no judge endpoint was given"):
        score_predictions(CFG, _gaia(tmp_path), None, tmp_path / "out", tmp_path / "cache")


def test_math_scores_and_report_with_published_numbers(tmp_path):
    with FakeJudgeServer() as server:
        gaia = score_predictions(CFG, _gaia(tmp_path), server.endpoint(), tmp_path / "out", tmp_path / "cache")
        aime = score_predictions(CFG, _aime(tmp_path), server.endpoint(), tmp_path / "out", tmp_path / "cache")
    # math_equal [[1, 0], [1 (0.5 = 1/2), 1]]; the fake judge only does substrings, the rule OR keeps them
    assert aime.meta["math_equal"] == pytest.approx(3 / 4)
    assert aime.meta["metrics"]["accuracy"]["value"] == pytest.approx(3 / 4)
    assert aime.meta["metrics"]["pass@2"]["value"] == pytest.approx(1.0)

    report = build_report(CFG, [gaia, aime], tmp_path / "out")
    table = pd.read_csv(report.meta["csv"])
    assert list(table["benchmark"]) == ["gaia", "aime24"]
    assert table.loc[0, "accuracy"] == pytest.approx(100 * 4 / 6)
    # arpo-qwen3-14b publishes GAIA pass@1 43.7 and pass@5 61.2 (llm_equal, as our judged GAIA), nothing for AIME24
    assert table.loc[0, "paper accuracy"] == 43.7 and table.loc[0, "paper pass@5"] == 61.2
    assert pd.isna(table.loc[1, "paper accuracy"])
    assert table.loc[0, "metric"] == "llm_equal" and table.loc[0, "pass@k verdict"] == "llm_equal"
    markdown = Path(report.meta["markdown"]).read_text()
    assert "## Published numbers" in markdown and "61.2" in markdown and "ARPO README overview" in markdown
    assert build_report(CFG, [gaia, aime], tmp_path / "out").fingerprint == report.fingerprint  # resumed

    with pytest.raises(ValueError, match="reference_setting='nope' has no published numbers"):
        build_report(CFG.model_copy(update={"reference_setting": "nope"}), [gaia], tmp_path / "out2")


def test_score_task_cache_ignores_the_judge_url_but_not_its_identity(tmp_path, prefect_harness):
    from tasks.stage_tasks import entry_task

    preds = _gaia(tmp_path)

    @flow
    def score_flow(judge) -> tuple[str, str]:
        state = entry_task("score")(CFG, preds, judge, str(tmp_path / "out"), str(tmp_path / "cache"),
                                    return_state=True)
        report = entry_task("report")(CFG, [state.result()], str(tmp_path / "out"), return_state=True)
        return state.name, report.name

    with FakeJudgeServer() as first, FakeJudgeServer() as second:
        assert first.port != second.port
        assert score_flow(first.endpoint()) == ("Completed", "Completed")
        assert score_flow(second.endpoint()) == ("Cached", "Cached")  # same judge, another port
        assert len(second.requests) == 0
        assert score_flow(second.endpoint(fingerprint="w2"))[0] == "Completed"  # other judge weights
        assert len(second.requests) == 5


def test_judge_against_the_real_vllm_server(tmp_path, vllm_endpoint):
    """Once against vLLM serving SmolLM2-135M: the openai client path works end to end."""
    from stages.eval.judge import Judge, JudgeRequest

    judge = Judge(vllm_endpoint, JudgeSection(max_tokens=8, concurrency=2), tmp_path / "judge.sqlite")
    verdicts = judge.judge_many([JudgeRequest("What is 2 + 2?", ("4",), "4"),
                                 JudgeRequest("Capital of France?", ("Paris",), "Berlin")])
    judge.cache.close()
    assert all(v.error is None and v.says_correct is not None and v.reply for v in verdicts)
    assert judge.calls == 2


@pytest.mark.slow
def test_eval_chain_on_the_tiny_model(tmp_path, tiny_model, tiny_config, synthetic_data, shared_data, vllm_endpoint):
    """EVAL-A's inference -> this scoring (the policy server as judge) -> report, over two real benchmarks and
    the generated set: the predictions contract holds between the two halves."""
    from stages.eval.benchmarks import load_benchmark
    from stages.eval.inference import run_inference

    cfg = tiny_config.eval.model_copy(update={
        "data_root": str(shared_data / "eval"), "max_questions": 1, "samples": 2, "pass_k": [1, 2],
        "max_tokens": 48, "max_total_tokens": 96, "bootstrap_samples": 100,
        "judge": JudgeSection(max_tokens=8, concurrency=2)})
    scores = []
    for name in ("gsm8k", "bamboogle", "synthetic"):
        preds = run_inference(cfg, tiny_config.agent, name, tiny_model, vllm_endpoint, synthetic_data,
                              tmp_path / "out", tmp_path / "cache")
        scores.append(score_predictions(cfg, preds, vllm_endpoint, tmp_path / "out", tmp_path / "cache"))
    for name, score in zip(("gsm8k", "bamboogle", "synthetic"), scores):
        s = score.meta
        loaded = load_benchmark(name, cfg.data_root, cap=1, synthetic_path=synthetic_data.files.get("eval_test"))
        assert (s["benchmark"], s["questions"], s["samples_per_question"]) == (name, 1, 2)
        assert s["benchmark_hash"] == loaded.content_hash and s["judged"] and s["judge_failures"] == 0
        assert 0.0 <= s["metrics"]["accuracy"]["value"] <= 1.0 and set(s["metrics"]) == {"accuracy", "pass@1",
                                                                                          "pass@2"}
    table = pd.read_csv(build_report(cfg, scores, tmp_path / "out").meta["csv"])
    assert list(table["benchmark"]) == ["gsm8k", "bamboogle", "synthetic"]
