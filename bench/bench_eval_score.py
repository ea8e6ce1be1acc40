"""Scoring throughput, each figure as a ratio against a baseline measured in the same run.

    .venv/bin/python bench/bench_eval_score.py [--math-items 120] [--judge-items 48] [--judge-latency 0.1]

1. math-verify over MATH500 answers (half the predictions equal to the gold in another form, half wrong):
   baseline = in-process, main thread, one by one; vs the process pool (`MathVerifier`) with 1 and 2 workers,
   pool start-up included. The pool exists for correctness (math-verify's signal timeouts need a main thread),
   so the interesting number is what it costs or saves.
2. LLM judge against a loopback OpenAI-compatible server that takes `--judge-latency` seconds per answer
   (a stand-in for a real judge model): baseline = concurrency 1; vs concurrency 8; vs a re-score that is
   answered from the SQLite verdict cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from stages.core.env import PROJECT_ROOT, configure_environment  # noqa: E402

configure_environment()


def math_pairs(count: int) -> list[tuple[str, list[str]]]:
    from stages.eval.benchmarks import load_benchmark

    items = load_benchmark("math500", PROJECT_ROOT.parent / "shared" / "data" / "eval", cap=count).items
    pairs = []
    for index, item in enumerate(items):
        gold = item.golds[0]
        prediction = f"\\boxed{{{gold}}}" if index % 2 == 0 else f"{gold} + 1"  # equal / not equal
        pairs.append((prediction, list(item.golds)))
    return pairs


def bench_math(count: int) -> dict[str, float]:
    from stages.agent.answer_match import math_equivalent
    from stages.eval.sample_metrics import MathVerifier

    pairs = math_pairs(count)
    start = time.perf_counter()
    baseline = [math_equivalent(p, g) for p, g in pairs]
    times = {"in-process": time.perf_counter() - start}
    for workers in (1, 2):
        start = time.perf_counter()
        with MathVerifier(workers=workers) as verifier:
            results = verifier.check(pairs)
        times[f"pool x{workers}"] = time.perf_counter() - start
        assert [r.equal for r in results] == baseline, "pool and in-process verdicts differ"
    times["equal fraction"] = sum(baseline) / len(baseline)
    return times


def bench_judge(count: int, latency: float) -> dict[str, float]:
    from stages.core.config.eval import JudgeSection
    from stages.eval.judge import Judge, JudgeRequest
    from tests.unit.test_eval_judge import FakeJudgeServer

    requests = [JudgeRequest(f"question {i}?", (f"answer {i}",), f"answer {i if i % 3 else -i}") for i in range(count)]
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, FakeJudgeServer(latency_s=latency) as server:
        for label, concurrency, cache in (("concurrency 1", 1, "c1"), ("concurrency 8", 8, "c8"),
                                          ("cached re-score", 8, "c8")):
            judge = Judge(server.endpoint(), JudgeSection(concurrency=concurrency), Path(tmp) / f"{cache}.sqlite")
            start = time.perf_counter()
            judge.judge_many(requests)
            times[label] = time.perf_counter() - start
            judge.cache.close()
        times["server calls"] = len(server.requests)
    return times


def report(title: str, times: dict[str, float], baseline: str, count: int) -> dict:
    print(f"\n{title}")
    base = times[baseline]
    rows = {}
    for label, seconds in times.items():
        if label in ("equal fraction", "server calls"):
            print(f"  {label:18s} {seconds:g}")
            continue
        speedup = base / seconds if seconds > 0 else float("inf")
        print(f"  {label:18s} {seconds:8.2f} s  {count / seconds:8.1f} items/s  x{speedup:5.2f} vs {baseline}")
        rows[label] = {"seconds": round(seconds, 3), "items_per_s": round(count / seconds, 2),
                       "speedup": round(speedup, 2)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--math-items", type=int, default=120)
    parser.add_argument("--judge-items", type=int, default=48)
    parser.add_argument("--judge-latency", type=float, default=0.1, help="seconds per judge answer")
    parser.add_argument("--out", default="outputs/bench/eval_score.json")
    args = parser.parse_args()
    out = {"math": report(f"math-verify, {args.math_items} MATH500 answers", bench_math(args.math_items),
                          "in-process", args.math_items),
           "judge": report(f"judge, {args.judge_items} verdicts at {args.judge_latency:g} s each",
                           bench_judge(args.judge_items, args.judge_latency), "concurrency 1", args.judge_items)}
    path = PROJECT_ROOT / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwritten to {path}")
    math, judge = out["math"], out["judge"]
    write_result("eval_score",
                 {"judge_concurrency_8_x": judge["concurrency 8"]["speedup"],
                  "judge_cached_x": judge["cached re-score"]["speedup"],
                  **{f"math_{k.replace(' ', '_').replace('-', '_')}_x": v["speedup"] for k, v in math.items()}},
                 summary="judge concurrency 8: {judge_concurrency_8_x:.1f}x; cached re-score {judge_cached_x:.0f}x",
                 what="scoring: judge concurrency 8 vs 1, a cached re-score; math-verify in process vs its process pool",
                 command="bench/bench_eval_score.py", details="eval.md#scoring-throughput-benchbench_eval_scorepy",
                 conditions={"math_items": args.math_items, "judge_items": args.judge_items,
                             "judge_latency_s": args.judge_latency})


if __name__ == "__main__":
    main()
