"""Rollout cost with KV-cache reuse vs full re-prefill (baseline), per strategy, one run, tiny model on CPU.

    .venv/bin/python bench/bench_rollout.py [--prompts 4] [--n 8] [--initial 4] [--max-response 160]
                                             [--temperature 0] [--strategies grpo,arpo,aepo (the default: all)]

For each strategy the same prompts and seed run twice on the transformers backend: `kv_reuse=True` (prompt
prefilled once per group, caches kept across rounds, branches start from their parent's cache) and
`kv_reuse=False` (every round re-prefills every context). Greedy decoding by default, so both modes generate
the same tokens and the forward-token ratio is exact; with --temperature > 0 the modes may drift apart by float
rounding. The prompts end with an assistant prefix that opens a search ("…</think>\\n<search>"): the
untrained tiny model rarely calls a tool on its own, and branching needs tool results. Search is the local BM25
backend over the generated corpus with short results (top 1, 120 characters), as in the integration tests.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.core.algorithm_spec import ALGORITHMS
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

PRIMER = "<think>I will search for it.</think>\n<search>"


def load(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.bootstrap import bootstrap_model
    from stages.core.config.loader import load_config
    from stages.core.rl_parquet import read_rl_parquet
    from stages.data import prepare_data
    from stages.generation.prompt_items import PromptItem, build_prompt_items

    torch.set_num_threads(args.threads)
    config = load_config("tiny-cpu")
    cache_root = PROJECT_ROOT / ".cache"
    outputs = cache_root / "bench-outputs"
    model_ref = bootstrap_model(config.model, outputs, cache_root)
    data = prepare_data(config.data, outputs)
    tok = AutoTokenizer.from_pretrained(model_ref.path)
    model = AutoModelForCausalLM.from_pretrained(model_ref.path, dtype=torch.float32, attn_implementation="sdpa")
    rows = [r for r in read_rl_parquet(data.file("rl_train")) if r.ability == "qa"][:args.prompts]
    primer = tok.encode(PRIMER, add_special_tokens=False)
    prompts = [PromptItem(p.group, p.prompt_ids + primer, p.question, p.ground_truth, p.ability)
               for p in build_prompt_items(rows, tok, 1024)]
    return config, model, tok, data, prompts


def run_once(model, tok, box, prompts, section, algorithm: str, reuse: bool) -> tuple[float, dict]:
    from stages.generation import load_backend
    from stages.rl.rollout import TreeRollout

    backend = load_backend("transformers", model, tok, kv_reuse=reuse)
    driver = TreeRollout(backend, box, tok, section, algorithm, seed=0, show_progress=False)
    start = time.perf_counter()
    batch = driver.rollout(prompts)
    return time.perf_counter() - start, batch.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--initial", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--strategies", default=",".join(ALGORITHMS.ordered()))  # every line of the algorithm table
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from stages.agent.toolbox import ToolBox
    from stages.core.config.agent import SearchSection
    from stages.core.config.rl import RolloutSection

    config, model, tok, data, prompts = load(args)
    agent = config.agent.model_copy(update={"search": SearchSection(top_k=1, max_chars_per_passage=120)})
    print(f"rollout cost, tiny model on CPU, {len(prompts)} prompts x n={args.n} (initial {args.initial}), "
          f"max response {args.max_response}, temperature {args.temperature}, call limit 2, beam 2")
    print(f"{'strategy':8} {'kv':5} {'wall s':>7} {'fwd tok/group':>13} {'prefill':>8} {'decode':>7} "
          f"{'reused':>7} {'calls/traj':>10} {'branches':>8} {'fresh':>5}  ratio vs no-reuse")
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as cache, \
            ToolBox.from_config(agent, str(data.file("corpus")), cache) as box:
        for name in args.strategies.split(","):
            # the algorithm's own rollout defaults (AEPO's branch penalty) and, where it has one, its probe
            spec = ALGORITHMS.get(name)
            probe = {"dynamic_rollouts": True, "probe_tokens": 32} if spec.governs("rollout.dynamic_rollouts") else {}
            section = RolloutSection(n=args.n, initial_rollouts=args.initial, beam_size=2,
                                     call_limit=2, max_prompt_length=1024, max_response_length=args.max_response,
                                     temperature=args.temperature, entropy_tokens=8,
                                     **spec.implied().get("rollout", {}), **probe)
            runs = {reuse: run_once(model, tok, box, prompts, section, name, reuse) for reuse in (False, True)}
            base_wall, base = runs[False]
            ratios[name] = {"fwd_fewer_x": round(base["forward_tokens"] / runs[True][1]["forward_tokens"], 2),
                            "wall_faster_x": round(base_wall / runs[True][0], 2)}
            for reuse, (wall, m) in runs.items():
                ratio = (f"fwd x{base['forward_tokens'] / m['forward_tokens']:.2f} fewer, wall x{base_wall / wall:.2f}"
                         if reuse else "(baseline)")
                print(f"{name:8} {'on' if reuse else 'off':5} {wall:7.1f} {m['forward_tokens_per_group']:13.0f} "
                      f"{m['prefill_tokens']:8.0f} {m['decode_tokens']:7.0f} {m['reused_tokens']:7.0f} "
                      f"{m['tool_calls_per_traj']:10.2f} {m['branches']:8.0f} {m['fresh']:5.0f}  {ratio}")
    fwd, wall = ([r[k] for r in ratios.values()] for k in ("fwd_fewer_x", "wall_faster_x"))
    write_result("rollout", {"fwd_fewer_x": [min(fwd), max(fwd)], "wall_faster_x": [min(wall), max(wall)],
                             "by_strategy": ratios},
                 summary="{fwd_fewer_x[0]:.1f}-{fwd_fewer_x[1]:.1f}x fewer forward tokens, "
                         "{wall_faster_x[0]:.1f}-{wall_faster_x[1]:.1f}x faster (" + ", ".join(ratios) + ")",
                 what="rollout forward tokens and wall time, KV reuse across rounds and branches vs re-prefill",
                 command="bench/bench_rollout.py", details="rollout.md#forward-tokens-measured-kv-reuse-vs-re-prefill",
                 conditions=vars(args))


if __name__ == "__main__":
    main()
