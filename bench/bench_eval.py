"""Eval throughput on the cpu server: samples/s of the agent loop at concurrency 1 (baseline) vs N, one run.

    .venv/bin/python bench/bench_eval.py [--questions 8] [--concurrency 8] [--max-tokens 64]

Both runs use a fresh server each (max_batch_size = N, one torch thread, prefix cache on), the same
questions of the tiny profile's `synthetic` benchmark, greedy decoding (so both runs generate the same
tokens) and fresh output folders. The concurrent run gains from the server's request batching: N samples
share each `generate` call and the prefill of their common system prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()


def stats(endpoint) -> dict:
    with urllib.request.urlopen(endpoint.url.removesuffix("/v1") + "/stats", timeout=10) as response:
        return json.loads(response.read())


def warm_up(endpoint) -> None:
    """One request first, so neither timed run pays the server's first-call costs."""
    body = json.dumps({"model": endpoint.model, "prompt": "Hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(endpoint.url + "/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def timed_run(cfg, agent, model, endpoint, data, concurrency: int, cache_root: Path) -> tuple[float, int, dict]:
    from stages.eval.inference import run_inference

    before = stats(endpoint)
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as out:
        start = time.perf_counter()
        ref = run_inference(cfg.model_copy(update={"concurrency": concurrency}), agent, "synthetic", model, endpoint,
                            data, out, cache_root, force=True)
        wall = time.perf_counter() - start
        rows = ref.meta["rows"]
    after = stats(endpoint)
    batches = {k: v - before["batch_size_histogram"].get(k, 0) for k, v in after["batch_size_histogram"].items()}
    return wall, rows, {"batches by size": {k: v for k, v in batches.items() if v},
                        "prefill tokens reused/computed": f"{after['prefix_reused_tokens']}/"
                                                          f"{after['prefix_computed_tokens']}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per generation call")
    parser.add_argument("--threads", type=int, default=1, help="server torch threads")
    args = parser.parse_args()

    import torch

    from stages.bootstrap import bootstrap_model
    from stages.core.config import load_config
    from stages.data import prepare_data
    from stages.eval.serving import serving

    torch.set_num_threads(1)
    config = load_config("tiny-cpu")
    cache_root = PROJECT_ROOT / ".cache"
    outputs = cache_root / "test-outputs"  # content-addressed: shares the tests' tiny model and data
    model = bootstrap_model(config.model, outputs, cache_root)
    data = prepare_data(config.data, outputs)
    cfg = config.eval.model_copy(update={"max_questions": args.questions, "samples": 1, "temperature": 0.0,
                                         "max_tokens": args.max_tokens, "max_total_tokens": 2 * args.max_tokens,
                                         "sample_timeout_s": 600.0})
    serve = config.serve.model_copy(update={"max_batch_size": args.concurrency, "threads": args.threads})
    results = {}
    for c in (1, args.concurrency):  # a fresh server each: neither run inherits the other's prefix cache
        with serving(serve, model, cache_root / "bench-outputs" / "logs") as endpoint:
            warm_up(endpoint)
            results[c] = timed_run(cfg, config.agent, model, endpoint, data, c, cache_root)
    base_wall, rows, _ = results[1]
    print(f"eval throughput, cpu server, {rows} synthetic samples, greedy, max_tokens {args.max_tokens}, "
          f"server threads {args.threads}")
    for c, (wall, n, info) in results.items():
        print(f"  concurrency {c:2d}: {wall:7.2f} s  {n / wall:6.3f} samples/s  x{base_wall / wall:4.2f}  {info}")
    print(f"ratio concurrency {args.concurrency} / 1: {base_wall / results[args.concurrency][0]:.2f}x samples/s")


if __name__ == "__main__":
    main()
