"""`arpo plan`: the deep-search summariser's calls and tokens, per RL step and per evaluation (hand-derived)."""

from __future__ import annotations

from pathlib import Path

from stages.core.config.loader import load_config
from stages.cost import estimate, render_markdown
from stages.cost.basis import Measured

URL = ["agent.search.summarizer.model=summ", "agent.search.summarizer.url=http://h/v1",
       "agent.search.summarizer.max_tokens=100", f"run.output_root={Path('/nonexistent')}"]


def _lines(est) -> dict[str, tuple]:
    return {line.what: (line.per_step, line.per_run, line.basis) for line in est.lines}


def test_eval_only_browsing_counts_the_browsing_benchmarks():
    # tiny-cpu: eval 2 samples, eval.max_search 10. Only gaia browses: 3 questions x 2 samples x 10 = 60 calls,
    # x 100 tokens = 6000 tokens. RL rollouts keep snippets: no per-step summariser line.
    cfg = load_config("tiny-cpu", [*URL, "eval.benchmarks=[synthetic, gaia]", "eval.browse=[gaia]"])
    lines = _lines(estimate(cfg, train_rows=84, eval_questions={"synthetic": 4, "gaia": 3}))
    assert lines["eval summariser calls"] == (None, 60, "bound")
    assert lines["eval summariser generated tokens"] == (None, 6000, "bound")
    assert "summariser calls" not in lines
    assert lines["eval search calls"] == (None, (4 + 3) * 2 * 10, "bound")     # unchanged: every benchmark searches


def test_browsing_rollouts_add_a_summary_per_search_call():
    # tiny-cpu RL: 8 trajectories x 2 calls = 16 search calls per step, 2 steps = 32; one summary each, <= 100 tokens.
    # browse.enabled also browses every benchmark: (4 + 3) x 2 x 10 = 140 eval calls.
    cfg = load_config("tiny-cpu", [*URL, "agent.search.browse.enabled=true", "eval.benchmarks=[synthetic, gaia]"])
    est = estimate(cfg, train_rows=84, eval_questions={"synthetic": 4, "gaia": 3})
    lines = _lines(est)
    assert lines["summariser calls"] == (16, 32, "bound")
    assert lines["summariser generated tokens"] == (1600, 3200, "bound")
    assert lines["eval summariser calls"] == (None, 140, "bound")
    # top_k 10 pages x 2 x 3000 characters
    assert any("up to 10 pages" in a and "6,000 characters" in a for a in est.assumptions)
    assert "| summariser calls | 16 | 32 | upper bound |" in render_markdown(est)
    # a measured run: search calls 4 and 6 per step -> mean 5 -> 5 summaries a step, 10 a run, 500 / 1000 tokens
    measured = Measured("m", [{"rollout/search_calls_executed": 4.0}, {"rollout/search_calls_executed": 6.0}])
    lines = _lines(estimate(cfg, train_rows=84, measured=measured, eval_questions={}))
    assert lines["summariser calls"] == (5, 10, "measured")
    assert lines["summariser generated tokens"] == (500, 1000, "measured")


def test_paper_profile_eval_summaries_with_a_served_summariser():
    # gaia 103 + hle 500 + webwalker 200 questions (xbench's file absent) x 5 samples x 10 searches = 40,150 calls,
    # x 4096 tokens = 164,454,400; the RL rollouts keep snippets
    cfg = load_config("arpo-qwen3-14b-deepsearch", ["agent.search.summarizer.url=null",
                                                    "agent.search.summarizer.path=Qwen/Qwen3-14B"])
    est = estimate(cfg, train_rows=None, eval_questions={"gaia": 103, "hle": 500, "webwalker": 200, "xbench": None})
    calls = est.line("eval summariser calls")
    assert calls.per_run == 40_150 and "served by the evaluation from Qwen/Qwen3-14B" in calls.note
    assert "not counted (files not here): ['xbench']" in calls.note
    assert est.line("eval summariser generated tokens").per_run == 164_454_400
    assert "summariser calls" not in _lines(est)
    none_here = _lines(estimate(cfg, train_rows=None, eval_questions={"gaia": None}))
    assert none_here["eval summariser calls"] == (None, None, "unknown")
    # no summariser: no summariser lines
    plain = _lines(estimate(load_config("tiny-cpu"), train_rows=84, eval_questions={"synthetic": 4}))
    assert not [name for name in plain if "summariser" in name]
