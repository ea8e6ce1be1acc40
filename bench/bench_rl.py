"""One local RL step on the CPU, before vs after the speed-ups, phase by phase, in one run.

    .venv/bin/python bench/bench_rl.py [--algo arpo] [--steps 3] [--configs before,after,after-vllm]

The tiny-cpu profile's RL section as the tiny run uses it (2 prompts x n = 4, initial 2, call limit 2, 768 prompt
and 256 response tokens, the tiny SFT policy so that the policy calls its tools; SFT cached in `--root`), trained
`--steps` steps under each configuration, each in its own process with one torch thread, all configurations at
the same time (on a shared box the load changes by the minute; side by side, every configuration sees the same
load, so their ratios hold; `--sequential` runs them one after the other):

    before      .venv       transformers rollouts (KV reuse); old log-probs recomputed (a no-grad pass);
                            every trajectory re-reads its prompt in the update
    after       .venv       transformers rollouts; the rollout's own log-probs (rl.trainer.old_logprobs: auto);
                            each group's prompt once per micro-batch (rl.trainer.shared_prompt)
    after-vllm  .venv-vllm  vLLM rollouts in process (weights reloaded in place every step); as `after`

`--update-ab` measures only the part after the rollout (old log-probs + update) before vs after on one batch in
one process, alternating, in CPU seconds (the most exact number this box gives).

Printed: per configuration the mean step (checkpoint saves excluded) and its phases -- rollout, old log-probs,
update -- in wall seconds and in process CPU seconds (all threads, vLLM's included; CPU seconds are what a phase
costs whatever else runs on the box, wall seconds what it took while the box was shared), tokens decoded per
step and forward calls, the load average while it ran, and every phase's ratio to `before`. The same seed and
prompts everywhere; the two transformers configurations sample the same tokens (the update's numbers differ only
by float rounding), the vLLM one samples its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.core.algorithm_spec import ALGORITHMS
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

CONFIGS = {
    "before": (".venv", ["rl.rollout.backend=transformers", "rl.trainer.old_logprobs=recompute",
                         "rl.trainer.shared_prompt=false"]),
    "after": (".venv", ["rl.rollout.backend=transformers", "rl.trainer.old_logprobs=auto",
                        "rl.trainer.shared_prompt=true"]),
    "after-vllm": (".venv-vllm", ["rl.rollout.backend=vllm", "rl.trainer.old_logprobs=auto",
                                  "rl.trainer.shared_prompt=true"]),
}
PHASES = ("rollout", "old_logprob", "update")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", default="arpo", choices=ALGORITHMS.ordered())  # the algorithm table's lines
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--sequential", action="store_true", help="one configuration after the other")
    parser.add_argument("--update-ab", action="store_true",
                        help="only old log-probs + update, before vs after on one batch in this process (CPU s)")
    parser.add_argument("--root", default=str(PROJECT_ROOT / "bench" / "results" / "rl-step"))
    parser.add_argument("-o", "--override", action="append", default=[], help="config override for every run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def overrides(args: argparse.Namespace, name: str) -> list[str]:
    return [f"rl.algorithm={args.algo}", f"rl.trainer.total_steps={args.steps}", f"rl.trainer.save_every={args.steps}",
            *CONFIGS[name][1], *args.override]


def policy_and_data(args: argparse.Namespace, cfg):
    from stages.bootstrap import bootstrap_model
    from stages.data import prepare_data
    from stages.sft import run_sft

    model = bootstrap_model(cfg.model, args.root, PROJECT_ROOT / ".cache")
    data = prepare_data(cfg.data, args.root)
    return run_sft(cfg.sft, cfg.agent, model, data, str(args.root), str(PROJECT_ROOT / ".cache")), data


def worker(args: argparse.Namespace, name: str) -> None:
    """Train `--steps` steps under configuration `name`; its metrics rows go to <root>/runs/<name>.json."""
    import torch

    from stages.core.atomic import read_jsonl, write_json
    from stages.core.config.loader import load_config
    from stages.rl.trainer import RLTrainer

    torch.set_num_threads(1)
    cfg = load_config("tiny-cpu", overrides(args, name))
    policy, data = policy_and_data(args, cfg)
    work = Path(args.root) / "runs" / name
    shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    RLTrainer(cfg.rl, cfg.agent, policy, data, work, PROJECT_ROOT / ".cache", seed=0).train()
    rows = read_jsonl(work / "metrics.jsonl")
    write_json(Path(args.root) / "runs" / f"{name}.json", {"rows": rows, "total_s": time.perf_counter() - start})


def start(args: argparse.Namespace, name: str) -> subprocess.Popen:
    venv, _ = CONFIGS[name]
    python = PROJECT_ROOT / venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: build it (scripts/setup.sh, scripts/setup-vllm.sh) or leave "
                         f"{name} out of --configs")
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = Path(args.root) / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
    with open(log, "w") as handle:
        return subprocess.Popen([str(python), __file__, *sys.argv[1:], "--worker", name], stdout=handle,
                                stderr=subprocess.STDOUT, env=env)


def run_all(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """The configurations side by side (or one after the other with --sequential); the load average while each ran."""
    batches = [[name] for name in names] if args.sequential else [names]
    results = {}
    for batch in batches:
        procs, loads = {name: start(args, name) for name in batch}, []
        while any(p.poll() is None for p in procs.values()):
            loads.append(os.getloadavg()[0])
            time.sleep(5)
        for name, proc in procs.items():
            if proc.returncode:
                raise SystemExit(f"{name} failed (exit {proc.returncode}); see {args.root}/runs/{name}.log")
            out = json.loads((Path(args.root) / "runs" / f"{name}.json").read_text())
            results[name] = summarize(out["rows"], out["total_s"], statistics.fmean(loads) if loads else 0.0)
    return results


def summarize(rows: list[dict], total_s: float, load: float) -> dict:
    """Means over the steps of one configuration (checkpoint saves excluded from the step)."""
    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in rows)

    out = {"steps": len(rows), "load": load, "startup_s": total_s - sum(r["timing/step_s"] for r in rows),
           "step_s": statistics.fmean(r["timing/step_s"] - r["timing/checkpoint_s"] for r in rows),
           "step_cpu_s": mean("timing/step_cpu_s"), "decode": mean("rollout/decode_tokens"),
           "calls": mean("rollout/forward_calls"), "length": mean("response/length"),
           "tools": mean("tools/calls_per_traj"), "branches": mean("rollout/branches_per_group"),
           "mismatch": mean("rollout/logp_mismatch")}
    for phase in PHASES:
        out[f"{phase}_s"], out[f"{phase}_cpu_s"] = mean(f"timing/{phase}_s"), mean(f"timing/{phase}_cpu_s")
    return out


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\n{args.algo}, tiny-cpu RL section, {args.steps} steps per configuration, one torch thread each, "
          f"{'one after the other' if args.sequential else 'side by side'}")
    head = ["config", "step s", "rollout s", "old-logp s", "update s", "step CPU s", "rollout CPU", "old-logp CPU",
            "update CPU", "decoded/step", "fwd calls", "resp len", "logp mismatch", "startup s", "load"]
    print(" | ".join(head))
    for name, r in results.items():
        print(" | ".join([name, *(f"{r[k]:.1f}" for k in ("step_s", "rollout_s", "old_logprob_s", "update_s",
                                                           "step_cpu_s", "rollout_cpu_s", "old_logprob_cpu_s",
                                                           "update_cpu_s", "decode", "calls", "length")),
                          f"{r['mismatch']:.1e}", f"{r['startup_s']:.0f}", f"{r['load']:.1f}"]))
    base = results.get("before")
    if base is None:
        return
    for name, r in results.items():
        if name == "before":
            continue
        parts = [f"{k} {r[k] / base[k]:.2f}x" for k in ("step_s", "step_cpu_s", "rollout_s", "rollout_cpu_s",
                                                         "update_s", "update_cpu_s") if base[k]]
        print(f"{name} / before: " + ", ".join(parts) + f"; old log-probs {r['old_logprob_s']:.1f} s vs "
              f"{base['old_logprob_s']:.1f} s")
        goal = r["step_s"] / base["step_s"]
        print(f"  goal (step <= 0.5x): {'met' if goal <= 0.5 else 'not met'} in wall time ({goal:.2f}x), "
              f"{r['step_cpu_s'] / base['step_cpu_s']:.2f}x in CPU time")


def update_ab(args: argparse.Namespace, repeats: int = 3) -> None:
    """The step after the rollout -- old log-probs + update -- before vs after, on the same batch in one process,
    alternating (before, after) `repeats` times from the same weights: CPU seconds, free of the box's drift.
    The batch: the tiny profile's first 2 RL prompts x n = 4, responses of the lengths a tiny ARPO step samples
    (100-250 tokens, mean ~175, a 40-token tool result with loss mask 0 in each), random token ids."""
    import copy
    import random

    import torch

    from stages.core.config.loader import load_config
    from stages.core.rl_parquet import read_rl_parquet
    from stages.generation.models import load_policy, load_tokenizer
    from stages.generation.prompt_items import build_prompt_items
    from stages.generation.types import RolloutBatch, RolloutGroup, Trajectory
    from stages.rl.trainer import make_optimizer
    from stages.rl.update import build_step_tensors, ppo_update

    torch.set_num_threads(1)
    cfgs = {name: load_config("tiny-cpu", overrides(args, name)).rl for name in ("before", "after")}
    policy, data = policy_and_data(args, load_config("tiny-cpu", overrides(args, "before")))
    tokenizer, model = load_tokenizer(policy), load_policy(policy)
    items = build_prompt_items(read_rl_parquet(data.file("rl_train"))[:2], tokenizer, 768)
    rng = random.Random(0)
    groups = []
    for item in items:
        trajs = []
        for i in range(4):
            n = rng.randrange(100, 250)
            mask = [1] * 40 + [0] * 40 + [1] * (n - 80)
            trajs.append(Trajectory(traj_id=i, group=item.group, prompt_ids=item.prompt_ids, loss_mask=mask,
                                    response_ids=[rng.randrange(100, 40000) for _ in range(n)],
                                    sample_logprobs=[-2.0] * n))
        groups.append(RolloutGroup(item.group, item.question, item.ground_truth, item.ability, trajs, 2))
    batch, rewards = RolloutBatch(groups), [1.0, 0.0, -1.0, 0.5, 0.0, 1.0, -1.0, 0.0]
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(repeats):
        for name, rl in cfgs.items():
            work = copy.deepcopy(model)
            optimizer = make_optimizer(work, rl)
            cpu = time.process_time()
            tensors = build_step_tensors(rl, work, None, batch, rewards, tokenizer.pad_token_id, torch.device("cpu"))
            ppo_update(rl, work, optimizer, tensors, rl.rollout.n, torch.device("cpu"))
            times[name].append(time.process_time() - cpu)
    before, after = (statistics.median(times[k]) for k in ("before", "after"))
    prompt = statistics.fmean(len(i.prompt_ids) for i in items)
    print(f"\nold log-probs + update on one batch (8 trajectories, prompts {prompt:.0f} tokens, responses mean "
          f"{statistics.fmean(len(t) for t in batch.trajectories):.0f}), median of {repeats} alternating runs, "
          f"CPU s: before {before:.1f}, after {after:.1f} ({after / before:.2f}x); all runs {times}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.root = str(Path(args.root).resolve())
    if args.worker:
        worker(args, args.worker)
        return
    if args.update_ab:
        update_ab(args)
        return
    from stages.core.config.loader import load_config

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    policy_and_data(args, load_config("tiny-cpu", overrides(args, names[0])))  # SFT once, in this environment
    results = run_all(args, names)
    (Path(args.root) / "summary.json").write_text(json.dumps(results, indent=1))
    report(results, args)
    record(results, args)


def record(results: dict[str, dict], args: argparse.Namespace) -> None:
    """The figures the report prints, as bench/results/rl.json."""
    figures = {f"{name.replace('-', '_')}_{key}": round(r[key], 2) for name, r in results.items()
               for key in ("step_s", "old_logprob_s", "rollout_s")}
    base, parts = results.get("before"), []
    for name, r in results.items():
        if base and name != "before":
            figures[f"{name.replace('-', '_')}_step_x"] = round(r["step_s"] / base["step_s"], 3)
            parts.append(f"{name}: step {{{name.replace('-', '_')}_step_x:.2f}}x of before, old log-probs "
                         f"{{{name.replace('-', '_')}_old_logprob_s:.0f}} s")
    summary = ("; ".join(parts) + (" (before: {before_old_logprob_s:.0f} s)" if parts else "")) or \
        "; ".join(f"{name}: step {{{name.replace('-', '_')}_step_s:.1f}} s" for name in results)
    write_result("rl", figures, summary=summary,
                 what=f"one local {args.algo.upper()} step before vs after the speed-ups (old log-probs reused, shared "
                      "prompts, vLLM rollouts), phase by phase",
                 command="bench/bench_rl.py", details="rl.md#benchmarks",
                 conditions={"algo": args.algo, "steps": args.steps, "configs": list(results),
                             "sequential": args.sequential, "overrides": args.override})


if __name__ == "__main__":
    main()
