"""Does RL learn? GRPO vs ARPO vs AEPO from one shared SFT policy, with held-out accuracy and intervals.

    .venv/bin/python bench/bench_learning.py                        # the experiment (resumable: rerun to continue)
    .venv/bin/python bench/bench_learning.py --seeds 0 --algos grpo --steps 2 --questions 8 --root /tmp/x  # smoke

Task and budgets: bench/learning.yaml over the tiny-cpu profile (products of two 3-digit numbers that need one
<python> call; SmolLM2-135M-Instruct). The SFT policy is trained once (LLaMA-Factory, cached) and evaluated on the
held-out test split; then every (algorithm, seed) pair trains from it with the same rollout budget (n trajectories
per prompt, prompts per step, steps) and its final policy is evaluated on the same questions
(stages.heldout). Each pair runs in its own process (`--jobs` at a time, one torch thread each) under a
wall-clock limit (`--run-timeout`); a run cut off there, or by a crash, continues from its last RL checkpoint the
next time the bench runs, and a finished pair's results file (`<root>/results/<algo>-s<seed>.json`) is reused.

Printed: a table (per algorithm: held-out accuracy with intervals, the gain over SFT with a paired bootstrap
interval, reward and training accuracy early vs late, tool calls per trajectory carried and executed, branches,
entropy, time), the verdicts (RL vs SFT beyond the seed-to-seed spread; ARPO vs GRPO), and a plot
(`<root>/learning.png`, `--png` copies it elsewhere). Inside a Prefect flow run the table and plot are also
published as artifacts (tasks.artifacts; no-ops otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

CONFIG = Path(__file__).with_name("learning.yaml")
ALGOS = ("grpo", "arpo", "aepo")
STEP_KEYS = ("step", "reward/mean", "accuracy", "entropy/mean", "tools/calls_per_traj",
             "rollout/tool_calls_executed_per_traj", "rollout/branches_per_group", "rollout/fresh_per_group",
             "reward/groups_without_signal", "reward/format_error_rate", "advantage/mean_abs", "clip_fraction",
             "ppo_kl", "grad_norm", "response/length", "timing/step_s", "timing/rollout_s", "timing/update_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default=",".join(ALGOS))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: learning.yaml)")
    parser.add_argument("--questions", type=int, default=80, help="held-out questions (test split)")
    parser.add_argument("--samples", type=int, default=2, help="held-out samples per question")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="held-out sampling temperature: RL's own (1.0) by default; 0 = greedy")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--run-timeout", type=float, default=900, help="wall seconds per run before it is stopped")
    parser.add_argument("--retries", type=int, default=0,
                        help="restart a run cut off by --run-timeout this many times in this invocation (it resumes)")
    parser.add_argument("--root", default=str(PROJECT_ROOT / "bench" / "results" / "learning"))
    parser.add_argument("--png", default=None, help="also copy the plot here (e.g. docs/img/learning.png)")
    parser.add_argument("--keep-optimizer", action="store_true", help="keep optimizer.pt of finished runs")
    parser.add_argument("-o", "--override", action="append", default=[], help="config override key.sub=value")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "sft" or "<algo>:<seed>"
    return parser.parse_args(argv)


def load(args: argparse.Namespace, algo: str = "grpo"):
    from stages.core.config import load_config

    steps = [f"rl.trainer.total_steps={args.steps}"] if args.steps else []
    return load_config("tiny-cpu", [*args.override, *steps, f"rl.algorithm={algo}"], extra_file=CONFIG)


def heldout_spec(args: argparse.Namespace, cfg):
    from stages.core.config.eval import HeldoutSection

    ro = cfg.rl.rollout
    return HeldoutSection(max_questions=args.questions, samples=args.samples, temperature=args.temperature,
                       max_response_length=ro.max_response_length, max_prompt_length=ro.max_prompt_length,
                       call_limit=ro.call_limit, reward=cfg.rl.trainer.reward, questions_per_batch=40)


def prepare(cfg, root: Path):
    """Base model, task set and the shared SFT policy (each cached in `root`)."""
    from stages.bootstrap import bootstrap_model
    from stages.data import prepare_data
    from stages.sft import run_sft

    cache = str(PROJECT_ROOT / ".cache")
    model = bootstrap_model(cfg.model, root, cache)
    data = prepare_data(cfg.data, root)
    return model, data, run_sft(cfg.sft, cfg.agent, model, data, str(root), cache)


def result_path(root: Path, job: str) -> Path:
    return root / "results" / f"{job.replace(':', '-s')}.json"


# ---- one run (a worker process) ------------------------------------------------------------------------------
def worker(args: argparse.Namespace, job: str) -> None:
    import torch
    from learning_report import advantage_sign_agreement

    from stages.core.atomic import read_jsonl, write_json
    from stages.heldout import evaluate_heldout
    from stages.rl.trainer import run_rl

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the time limit: unwind so tools and caches close
    root, cache = Path(args.root), str(PROJECT_ROOT / ".cache")
    algo, _, seed = job.partition(":")
    cfg = load(args, "grpo" if job == "sft" else algo)
    _, data, sft = prepare(cfg, root)
    policy, rows, signs = sft, [], {}
    start = time.perf_counter()
    if job != "sft":
        policy = run_rl(cfg.rl, cfg.agent, sft, data, root, cache, seed=int(seed))
        rows = [{k: r.get(k) for k in STEP_KEYS} for r in read_jsonl(policy.meta["metrics"])]
        dumps = [row for path in sorted(Path(policy.meta["rollouts"]).glob("step_*.jsonl")) for row in read_jsonl(path)]
        signs = advantage_sign_agreement(dumps)
    rl_s = time.perf_counter() - start
    scores = evaluate_heldout(heldout_spec(args, cfg), cfg.agent, policy, data, root, cache)
    predictions = read_jsonl(Path(scores.path).with_name("predictions.jsonl"))
    write_json(result_path(root, job), {
        "job": job, "algorithm": algo if job != "sft" else "sft", "seed": int(seed) if seed else None,
        "config": {"rl": cfg.rl.model_dump(mode="json"), "sft": cfg.sft.model_dump(mode="json")},
        "steps": rows, "heldout": scores.meta, "heldout_path": scores.path,
        "correct_Q": [sum(p["correct"]) / len(p["correct"]) for p in predictions],
        "questions": [p["question"] for p in predictions], "rl_seconds_last_attempt": rl_s,
        "advantage_signs": signs,
        "policy": policy.path})
    if job != "sft" and not args.keep_optimizer:  # 1 GB per finished run; nothing resumes a finished run
        (Path(policy.path) / "optimizer.pt").unlink(missing_ok=True)


# ---- the pool of workers (main process) ------------------------------------------------------------------------
def run_pool(args: argparse.Namespace, jobs: list[str], root: Path) -> dict[str, list[dict]]:
    """Each job in its own process, `args.jobs` at a time; wall, CPU (os.wait4) and load average per attempt."""
    attempts: dict[str, list[dict]] = {job: [] for job in jobs}
    pending, running = list(jobs), {}
    loads: list[float] = []
    (root / "logs").mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", job]
            log = open(root / "logs" / f"{job.replace(':', '-s')}.log", "a")  # noqa: SIM115 - closed when it ends
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            running[job] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.time(), log,
                            os.getloadavg()[0])
            print(f"[{time.strftime('%H:%M:%S')}] started {job}", flush=True)
        time.sleep(5)
        loads.append(os.getloadavg()[0])
        for job, (proc, started, log, load0) in list(running.items()):
            timed_out = time.time() - started > args.run_timeout and job != "sft"
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # not Popen.poll: wait4 also gives the CPU time
            if pid == 0:
                if timed_out:
                    proc.terminate()  # reaped on the next pass; the run resumes from its checkpoint next time
                continue
            log.close()
            del running[job]
            record = {"job": job, "wall_s": time.time() - started, "cpu_s": usage.ru_utime + usage.ru_stime,
                      "exit": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
                      "load_start": load0, "load_end": os.getloadavg()[0]}
            attempts[job].append(record)
            if timed_out and len(attempts[job]) <= args.retries:
                pending.append(job)
            with open(root / "attempts.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(f"[{time.strftime('%H:%M:%S')}] {job}: exit {record['exit']}{' (timed out)' if timed_out else ''}"
                  f", {record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} s CPU", flush=True)
    return {"attempts": attempts, "mean_load": sum(loads) / len(loads) if loads else os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args, args.worker)
        return 0
    import resource

    from learning_report import report

    root = Path(args.root).resolve()
    args.root = str(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = load(args)
    start, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    os.environ.setdefault("OMP_NUM_THREADS", "2")  # LLaMA-Factory's SFT gets both cores
    _, _, sft = prepare(cfg, root)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    sft_file = root / "sft_time.json"  # the first (uncached) preparation's cost, kept for later reports
    if not sft_file.is_file():
        sft_file.write_text(json.dumps({"wall_s": time.time() - start, "load": os.getloadavg()[0],
                                        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime +
                                                                                      before.ru_stime)}))
    sft_time = {**json.loads(sft_file.read_text()),
                "train_runtime_s": sft.meta.get("metrics", {}).get("train_runtime")}  # LLaMA-Factory's own clock
    jobs = ["sft"] + [f"{a}:{s}" for s in args.seeds.split(",") for a in args.algos.split(",")]
    todo = [job for job in jobs if not result_path(root, job).is_file()]
    pool = run_pool(args, todo, root) if todo else {"attempts": {}, "mean_load": os.getloadavg()[0]}
    missing = [job for job in jobs if not result_path(root, job).is_file()]
    results = {job: json.loads(result_path(root, job).read_text()) for job in jobs if job not in missing}
    timing = {"sft": sft_time, "bench_wall_s": time.time() - start, "mean_load": pool["mean_load"],
              "attempts": [json.loads(line) for line in (root / "attempts.jsonl").read_text().splitlines()]
              if (root / "attempts.jsonl").is_file() else []}
    png = report(results, timing, root, missing)
    if args.png and png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, args.png)
    if missing:
        print(f"\nnot finished: {', '.join(missing)}; rerun the same command to continue them")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
