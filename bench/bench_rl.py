"""GRPO vs ARPO vs AEPO on the tiny model and the generated tasks: same budget, same prompts, same seed, one run.

    .venv/bin/python bench/bench_rl.py [--policy base|sft] [--steps 2] [--prompts 2] [--n 4] [--initial 2]
                                       [--max-new 96] [--call-limit 2]

Per algorithm it trains `--steps` RL steps (rollouts with real tools -> rewards -> update) and reports, from the
trainer's metrics: tool calls per trajectory, branches and fresh roots per group, forward tokens (prefill +
decode) per group with KV reuse, and wall time per step (checkpoint saves excluded). Then it repeats step 1's
rollout from the initial policy with the same seed and `rl.rollout.kv_reuse=false` (every round re-prefills the
whole context) and reports its forward tokens per group: the KV-reuse saving. Ratios are against GRPO (time,
tool calls) and against the no-reuse run (forward tokens), all measured in this run.

`--policy sft` first runs the tiny profile's cold-start SFT (cached after the first run) so that the policy
actually calls tools; the untuned base model rarely does, and ARPO/AEPO only branch after tool calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

import torch

ALGOS = {name: [f"rl.algorithm={name}"] for name in ("grpo", "arpo", "aepo")}  # aepo: its defaults come with it
ROOT = PROJECT_ROOT / ".cache" / "bench-rl"  # own folder: other benches clean theirs
CACHE = PROJECT_ROOT / ".cache"


def base_overrides(args) -> list[str]:
    return [f"rl.rollout.n={args.n}", f"rl.rollout.initial_rollouts={args.initial}",
            f"rl.trainer.train_batch_size={args.prompts}", f"rl.trainer.ppo_mini_batch_size={args.prompts}",
            f"rl.trainer.micro_batch_size={args.n}", f"rl.rollout.max_response_length={args.max_new}",
            f"rl.rollout.call_limit={args.call_limit}", f"rl.trainer.total_steps={args.steps}",
            f"rl.trainer.save_every={args.steps}", "rl.trainer.dump_rollouts=false"]


def policy_and_data(args):
    from stages.bootstrap import bootstrap_model
    from stages.core.config import load_config
    from stages.data import prepare_data

    cfg = load_config("tiny-cpu")
    model = bootstrap_model(cfg.model, ROOT, CACHE)
    data = prepare_data(cfg.data, ROOT)
    if args.policy_path:
        from stages.core.fingerprint import hash_path
        from stages.core.refs import ModelRef

        folder = Path(args.policy_path).resolve()
        return ModelRef(path=str(folder), fingerprint=hash_path(folder / "config.json"), name=folder.name,
                        template=model.template), data
    if args.policy == "sft":
        from stages.sft import run_sft

        return run_sft(cfg.sft, cfg.agent, model, data, str(ROOT), str(CACHE)), data
    return model, data


def train(cfg, policy, data, workdir: Path) -> list[dict]:
    from stages.core.atomic import read_jsonl
    from stages.rl.trainer import RLTrainer

    RLTrainer(cfg.rl, cfg.agent, policy, data, workdir, CACHE, seed=0).train()
    return read_jsonl(workdir / "metrics.jsonl")


def no_reuse_forward_tokens(cfg, policy, data) -> tuple[float, float]:
    """Step 1's rollout again, from the initial policy, same prompts and seed, KV reuse off."""
    from stages.data import read_rl_parquet
    from stages.generation.models import load_policy, load_tokenizer
    from stages.generation.session import RolloutSession
    from stages.rl.rollout import RolloutEngine
    from stages.rl.trainer import epoch_order, rollout_seed

    rl = cfg.rl.model_copy(update={"rollout": cfg.rl.rollout.model_copy(update={"kv_reuse": False})})
    rows = read_rl_parquet(data.file("rl_train"))
    order = epoch_order(len(rows), 0, 0)[: rl.trainer.train_batch_size]
    session = RolloutSession(rl.rollout, cfg.agent, load_policy(policy), load_tokenizer(policy), data, CACHE,
                             engine=RolloutEngine)
    try:
        batch = session.rollout([rows[i] for i in order], seed=rollout_seed(0, 0))
    finally:
        session.close()
    return batch.metrics["forward_tokens_per_group"], batch.metrics["response_tokens_per_traj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=["base", "sft"], default="base")
    parser.add_argument("--policy-path", help="an HF folder to start from instead (e.g. an SFT output)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--initial", type=int, default=2)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--call-limit", type=int, default=2)
    parser.add_argument("--algos", default="grpo,arpo,aepo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from stages.core.config import load_config

    policy, data = policy_and_data(args)
    results = {}
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        for algo in args.algos.split(","):
            cfg = load_config("tiny-cpu", overrides=base_overrides(args) + ALGOS[algo])
            rows = train(cfg, policy, data, Path(tmp) / algo)
            no_kv, no_kv_len = no_reuse_forward_tokens(cfg, policy, data)
            results[algo] = {
                "tools": statistics.mean(r["tools/calls_per_traj"] for r in rows),
                "branches": statistics.mean(r["rollout/branches_per_group"] for r in rows),
                "fresh": statistics.mean(r["rollout/fresh_per_group"] for r in rows),
                "length": statistics.mean(r["response/length"] for r in rows),
                "fwd_kv": rows[0]["rollout/forward_tokens_per_group"], "len_kv": rows[0]["response/length"],
                "fwd_nokv": no_kv, "len_nokv": no_kv_len,
                "step_s": statistics.mean(r["timing/step_s"] - r["timing/checkpoint_s"] for r in rows),
                "rollout_s": statistics.mean(r["timing/rollout_s"] for r in rows),
            }
    report(results, args)


def report(results: dict[str, dict], args) -> None:
    print(f"\npolicy={args.policy_path or args.policy}, {args.prompts} prompts x n={args.n} (initial {args.initial}), "
          f"{args.max_new} response tokens, call limit {args.call_limit}, {args.steps} steps each")
    head = (f"{'algo':>5} {'tools/traj':>10} {'branch/grp':>10} {'fresh/grp':>9} {'resp len':>8} "
            f"{'fwd/grp KV':>10} {'fwd/grp noKV':>12} {'KV saving':>9} {'step s':>7} {'rollout s':>9}")
    print(head)
    for algo, r in results.items():
        print(f"{algo:>5} {r['tools']:10.2f} {r['branches']:10.2f} {r['fresh']:9.2f} {r['length']:8.1f} "
              f"{r['fwd_kv']:10.0f} {r['fwd_nokv']:12.0f} {r['fwd_nokv'] / r['fwd_kv']:8.2f}x "
              f"{r['step_s']:7.1f} {r['rollout_s']:9.1f}")
    if "grpo" in results:
        g = results["grpo"]
        for algo, r in results.items():
            if algo != "grpo":
                tools = f"{r['tools'] / g['tools']:.2f}x" if g["tools"] else "n/a (GRPO made no call)"
                print(f"{algo} / grpo: step time {r['step_s'] / g['step_s']:.2f}x, tool calls per trajectory "
                      f"{tools}, forward tokens per group (KV) {r['fwd_kv'] / g['fwd_kv']:.2f}x")


if __name__ == "__main__":
    main()
