"""Does cold-start SFT teach the TIR format? Base model vs SFT checkpoint on held-out generated questions.

Both models answer the same test-split questions of the generated task set with the RL tree rollout (greedy,
real tools, results inserted exactly as in RL). Printed per model: format-valid rate (check_format), tool-call
rate (>= 1 complete call), answer accuracy (the reference reward's exact match), mean reference reward, and the
SFT / base ratio measured in this run (the difference for the reward, which can be negative).

    .venv/bin/python bench/bench_sft_format.py                  # tiny-cpu profile, 24 questions
    .venv/bin/python bench/bench_sft_format.py --questions 8 -o sft.max_steps=12
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from stages.core.env import configure_environment, free_cpu_threads  # noqa: E402

METRICS = ("format_valid", "tool_call", "accuracy", "mean_reward")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="tiny-cpu")
    parser.add_argument("-o", "--override", action="append", default=[], help="config override key.sub=value")
    parser.add_argument("--questions", type=int, default=24, help="test-split questions (math and qa mixed)")
    parser.add_argument("--max-new-tokens", type=int, default=384, help="response budget, tool results included")
    parser.add_argument("--out", default="outputs/bench/sft_format.json")
    return parser.parse_args()


def ratio(new: float, base: float) -> str:
    if base == 0:
        return "inf" if new > 0 else "n/a"
    return f"{new / base:.2f}x"


def main() -> int:
    args = parse_args()
    configure_environment()
    import torch

    torch.set_num_threads(free_cpu_threads())
    from stages.bootstrap import bootstrap_model
    from stages.core.atomic import read_jsonl, write_json
    from stages.core.config.loader import load_config
    from stages.data import prepare_data
    from stages.generation.samples import format_metrics, sample, sampling_settings
    from stages.sft import run_sft

    cfg = load_config(args.profile, args.override)
    root, cache = cfg.run.output_root, cfg.run.cache_root
    model = bootstrap_model(cfg.model, root, cache)
    data = prepare_data(cfg.data, root)
    start = time.perf_counter()
    sft = run_sft(cfg.sft, cfg.agent, model, data, root, cache)
    sft_s = time.perf_counter() - start
    tasks = [t for t in read_jsonl(data.file("tasks")) if t["split"] == "test"][: args.questions]
    rl = sampling_settings(n=1, temperature=0.0, max_new_tokens=args.max_new_tokens,
                           call_limit=cfg.agent.limits.max_calls)
    results, seconds = {}, {}
    for name, policy in (("base", model), ("sft", sft)):
        start = time.perf_counter()
        results[name] = format_metrics(sample(policy, tasks, cfg.agent, data, cache, rl, seed=cfg.run.seed))
        seconds[name] = time.perf_counter() - start
    kinds = {k: sum(t["kind"] == k for t in tasks) for k in ("math", "qa")}
    print(f"\nSFT format benchmark ({args.profile}; {len(tasks)} test questions {kinds}; greedy; "
          f"SFT {sft.meta.get('metrics', {}).get('global_step')} steps, stage {sft_s:.0f} s incl. cache)")
    print(f"{'metric':<14}{'base':>10}{'sft':>10}{'sft/base':>10}")
    for metric in METRICS:
        base, new = results["base"][metric], results["sft"][metric]
        # the reward lies in [-1, 1.1]: a ratio of negative numbers means nothing, so it gets the difference
        change = f"{new - base:+.3f}" if metric == "mean_reward" else ratio(new, base)
        print(f"{metric:<14}{base:>10.3f}{new:>10.3f}{change:>10}")
    print(f"{'sampling s':<14}{seconds['base']:>10.1f}{seconds['sft']:>10.1f}"
          f"{ratio(seconds['sft'], seconds['base']):>10}")
    write_json(args.out, {"profile": args.profile, "overrides": args.override, "questions": len(tasks), "kinds": kinds,
                          "results": results, "sampling_seconds": seconds, "sft_checkpoint": sft.path,
                          "sft_metrics": sft.meta.get("metrics", {})})
    print(f"written {args.out}")
    write_result("sft_format", {f"{metric}_{name}": round(results[name][metric], 3) for metric in METRICS
                                for name in ("base", "sft")},
                 summary="valid format {format_valid_base:.2f} -> {format_valid_sft:.2f}, tool use {tool_call_base:.2f} "
                         "-> {tool_call_sft:.2f}, accuracy {accuracy_base:.2f} -> {accuracy_sft:.2f}",
                 what="base vs SFT model on held-out tasks with real tools",
                 command="bench/bench_sft_format.py", details="sft.md#measured-on-the-tiny-profile-cpu",
                 conditions={"profile": args.profile, "overrides": args.override, "questions": len(tasks),
                             "kinds": kinds, "max_new_tokens": args.max_new_tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
