"""Does ARPO beat GRPO? GRPO vs ARPO vs AEPO from one shared SFT policy per task family, several seeds, held-out
accuracy with paired bootstrap intervals, tool calls, branches, format errors and collapse alarms per run.

    .venv/bin/python bench/bench_learning.py                       # the experiment (resumable: rerun to continue)
    .venv/bin/python bench/bench_learning.py --families arith --seeds 0 --algos grpo,arpo --steps 2 \\
        --questions 8 --root /tmp/x                                 # smoke

Task families (settings: bench/learning.yaml, then bench/learning-<family>.yaml, over the tiny-cpu profile;
SmolLM2-135M-Instruct): `arith` (products of two 3-digit numbers, one <python> call) and `chain` (a search over
the generated corpus, then python on the year it returned: two dependent calls). Per family the SFT policy is
trained once (LLaMA-Factory, cached) and evaluated on the held-out test split; then every (algorithm, seed) pair
trains from it with the same rollout budget (n trajectories per prompt, prompts per step, steps) and its final
policy is evaluated on the same questions (stages.heldout). Each run is its own process (`--jobs` at a time, one
torch thread each; under `--python`, vLLM's interpreter by default, with `--backend vllm` rollouts and held-out
generation) under a wall-clock limit (`--run-timeout`); a run cut off there, or by a crash, continues from its last
RL checkpoint the next time the bench runs, and a finished run's results file
(`<root>/results/<family>/<algo>-s<seed>.json`) is reused.

Printed per family: a table (held-out accuracy with intervals, the gain over SFT with a paired bootstrap interval,
reward and training accuracy early vs late, tool calls per trajectory in training and at evaluation, branches,
format errors, alarms), the verdicts on the papers' two claims (ARPO vs GRPO and AEPO vs GRPO held-out accuracy
with a two-level bootstrap over questions and seeds; ARPO's tool calls relative to GRPO's), every collapsed run with
the alarm that caught it, and a plot (`<root>/learning-<family>.png`; `--png-dir` copies it). Inside a Prefect flow
run the tables and plots are also published as artifacts (tasks.artifacts; no-ops otherwise).
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

from bench.results import write_result
from stages.core.algorithm_spec import SPECS as ALGORITHM_SPECS
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

BENCH = Path(__file__).resolve().parent
FAMILIES = ("arith", "chain")
ALGOS = tuple(spec.name for spec in ALGORITHM_SPECS)   # the algorithm table, in its order
BASELINE = next(spec.name for spec in ALGORITHM_SPECS if not spec.branches)  # independent samples: GRPO
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
STEP_KEYS = ("step", "reward/mean", "accuracy", "entropy/mean", "tools/calls_per_traj",
             "rollout/tool_calls_executed_per_traj", "rollout/branches_per_group", "rollout/fresh_per_group",
             "reward/groups_without_signal", "reward/format_error_rate", "advantage/mean_abs", "clip_fraction",
             "ppo_kl", "grad_norm", "rollout/logp_mismatch", "response/length", "finish/length", "timing/step_s",
             "timing/rollout_s",
             "timing/old_logprob_s", "timing/update_s", "timing/step_cpu_s", "alarm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--algos", default=",".join(ALGOS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: learning.yaml)")
    parser.add_argument("--questions", type=int, default=80, help="held-out questions (test split)")
    parser.add_argument("--samples", type=int, default=1, help="held-out samples per question (RL policies)")
    parser.add_argument("--sft-samples", type=int, default=4,
                        help="held-out samples per question for the SFT policy: every run's gain is measured against "
                             "it, so its sampling noise enters every gain alike")
    parser.add_argument("--tag", default="", help="a variant of the experiment (with its -o overrides): its runs and "
                        "report go to results/<family>@<tag>/, beside the untagged ones; data, SFT and the SFT "
                        "baselines are shared, so a tag may change RL settings only (rl.optim, rl.advantage, ...)")
    parser.add_argument("--no-sft-steps", action="store_true",
                        help="skip the SFT policy's reward on every RL step's prompts (bench/learning_baseline.py)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="held-out sampling temperature: RL's own (1.0) by default; 0 = greedy")
    parser.add_argument("--backend", choices=["vllm", "transformers"], default="vllm" if VLLM_PYTHON.exists()
                        else "transformers", help="rollouts and held-out generation (vllm needs --python)")
    parser.add_argument("--python", default=str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable,
                        help="interpreter of the worker processes (RL + held-out evaluation)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--run-timeout", type=float, default=3600, help="wall seconds per run before it is stopped")
    parser.add_argument("--retries", type=int, default=1,
                        help="restart a run cut off by --run-timeout this many times in this invocation (it resumes)")
    parser.add_argument("--root", default=str(PROJECT_ROOT / "bench" / "results" / "learning"))
    parser.add_argument("--png-dir", default=None, help="also copy the plots here (e.g. docs/img)")
    parser.add_argument("--keep-optimizer", action="store_true", help="keep optimizer.pt of finished runs")
    parser.add_argument("-o", "--override", action="append", default=[], help="config override key.sub=value")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "<family>/sft" or "<family>/<algo>:<seed>"
    parser.add_argument("--eval-only", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def overlay(family: str) -> dict:
    """bench/learning.yaml deep-merged with bench/learning-<family>.yaml (what load() puts over tiny-cpu)."""
    from stages.core.config.loader import deep_merge, read_yaml

    path = BENCH / f"learning-{family}.yaml"
    if not path.is_file():
        raise SystemExit(f"unknown task family {family!r}: no {path}; families: {', '.join(FAMILIES)}")
    return deep_merge(read_yaml(BENCH / "learning.yaml"), read_yaml(path))


def load(args: argparse.Namespace, family: str, algo: str = BASELINE):
    import tempfile

    import yaml

    from stages.core.config.loader import load_config

    steps = [f"rl.trainer.total_steps={args.steps}"] if args.steps else []
    backend = [f"rl.rollout.backend={args.backend}"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(overlay(family), handle)
    try:
        return load_config("tiny-cpu", [*backend, *args.override, *steps, f"rl.algorithm={algo}"],
                           extra_file=handle.name)
    finally:
        os.unlink(handle.name)


def heldout_spec(args: argparse.Namespace, cfg, samples: int):
    from stages.core.config.eval import HeldoutSection

    ro = cfg.rl.rollout
    return HeldoutSection(max_questions=args.questions, samples=samples, temperature=args.temperature,
                          max_response_length=ro.max_response_length, max_prompt_length=ro.max_prompt_length,
                          call_limit=ro.call_limit, reward=cfg.rl.trainer.reward, questions_per_batch=40,
                          backend=args.backend)


def prepare(cfg, root: Path):
    """Base model, task set and the family's SFT policy (each cached in `root`)."""
    from stages.bootstrap import bootstrap_model
    from stages.data import prepare_data
    from stages.sft import run_sft

    cache = str(PROJECT_ROOT / ".cache")
    model = bootstrap_model(cfg.model, root, cache)
    data = prepare_data(cfg.data, root)
    return model, data, run_sft(cfg.sft, cfg.agent, model, data, str(root), cache)


def result_path(root: Path, job: str, tag: str = "") -> Path:
    """results/<family>[@<tag>]/<run>.json; the SFT policy's files are shared by every tag."""
    family, _, run = job.partition("/")
    shared = run == "sft" or run.startswith("sftsteps:")
    folder = family if shared or not tag else f"{family}@{tag}"
    return root / "results" / folder / f"{run.replace(':', '-s')}.json"


# ---- one run (a worker process) ------------------------------------------------------------------------------
def worker(args: argparse.Namespace, job: str) -> None:
    """RL (cached once done), then the held-out evaluation and the results file. With vLLM the evaluation runs in
    a child process: a second in-process vLLM engine fails to start once the search tool has imported numba
    (vllm 0.32's kernel-override scan trips over llvmlite's wrappers), and a fresh process also frees RL's memory."""
    import torch

    from stages.rl.stage import run_rl

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the time limit: unwind so tools and caches close
    family, _, run = job.partition("/")
    algo, _, seed = run.partition(":")
    cfg = load(args, family, BASELINE if run == "sft" or algo == "sftsteps" else algo)
    _, data, sft = prepare(cfg, Path(args.root))
    if algo == "sftsteps":
        from bench.learning_baseline import sft_step_rewards

        sft_step_rewards(cfg, sft, data, int(seed), result_path(Path(args.root), job))
        return
    if run != "sft" and not args.eval_only:
        start = time.perf_counter()
        run_rl(cfg.rl, cfg.agent, sft, data, args.root, str(PROJECT_ROOT / ".cache"), seed=int(seed))
        result_path(Path(args.root), job, args.tag).parent.mkdir(parents=True, exist_ok=True)
        result_path(Path(args.root), job, args.tag).with_suffix(".rl_s").write_text(str(time.perf_counter() - start))
    if args.backend == "vllm" and not args.eval_only:
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--eval-only"], check=True)
        return
    evaluate(args, job, cfg, data, sft)


def evaluate(args: argparse.Namespace, job: str, cfg, data, sft) -> None:
    from learning_report import advantage_sign_agreement

    from stages.core.atomic import read_jsonl, write_json
    from stages.heldout import evaluate_heldout
    from stages.rl.stage import run_rl

    root, cache = Path(args.root), str(PROJECT_ROOT / ".cache")
    family, _, run = job.partition("/")
    algo, _, seed = run.partition(":")
    policy, rows, signs, alarms = sft, [], {}, []
    if run != "sft":
        policy = run_rl(cfg.rl, cfg.agent, sft, data, root, cache, seed=int(seed))  # done: the stage's marker
        stage = Path(policy.path).parents[1]
        rows = [{k: r.get(k) for k in STEP_KEYS} for r in read_jsonl(stage / "metrics.jsonl")]
        dumps = [row for path in sorted((stage / "rollouts").glob("step_*.jsonl")) for row in read_jsonl(path)]
        signs = advantage_sign_agreement(dumps)
        alarms = read_jsonl(stage / "alarms.jsonl") if (stage / "alarms.jsonl").is_file() else []
    samples = args.sft_samples if run == "sft" else args.samples
    scores = evaluate_heldout(heldout_spec(args, cfg, samples), cfg.agent, policy, data, root, cache)
    predictions = read_jsonl(Path(scores.path).with_name("predictions.jsonl"))
    rl_s = result_path(root, job, args.tag).with_suffix(".rl_s")
    write_json(result_path(root, job, args.tag), {
        "job": job, "tag": args.tag, "family": family, "algorithm": algo if run != "sft" else "sft",
        "seed": int(seed) if seed else None,
        "config": {"rl": cfg.rl.model_dump(mode="json"), "sft": cfg.sft.model_dump(mode="json")},
        "steps": rows, "alarms": alarms, "heldout": scores.meta, "heldout_path": scores.path,
        "correct_Q": [sum(p["correct"]) / len(p["correct"]) for p in predictions],
        "questions": [p["question"] for p in predictions],
        "rl_seconds_last_attempt": float(rl_s.read_text()) if rl_s.is_file() else None,
        "advantage_signs": signs, "policy": policy.path})
    if run != "sft" and not args.keep_optimizer:  # 1 GB per finished run; nothing resumes a finished run
        (Path(policy.path) / "optimizer.pt").unlink(missing_ok=True)


# ---- the pool of workers (main process) ------------------------------------------------------------------------
def run_pool(args: argparse.Namespace, jobs: list[str], root: Path) -> dict:
    """Each job in its own process, `args.jobs` at a time; wall, CPU (os.wait4) and load average per attempt."""
    attempts: dict[str, list[dict]] = {job: [] for job in jobs}
    pending, running = list(jobs), {}
    loads: list[float] = []
    (root / "logs").mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            cmd = [args.python, __file__, *sys.argv[1:], "--worker", job]
            name = job.replace("/", "-").replace(":", "-s") + (f"@{args.tag}" if args.tag else "")
            log = open(root / "logs" / f"{name}.log", "a")  # noqa: SIM115
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT_ROOT),
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
            running[job] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.time(), log,
                            os.getloadavg()[0])
            print(f"[{time.strftime('%H:%M:%S')}] started {job}", flush=True)
        time.sleep(5)
        loads.append(os.getloadavg()[0])
        for job, (proc, started, log, load0) in list(running.items()):
            timed_out = time.time() - started > args.run_timeout and not job.endswith("/sft")
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # not Popen.poll: wait4 also gives the CPU time
            if pid == 0:
                if timed_out:
                    proc.terminate()  # reaped on the next pass; the run resumes from its checkpoint next time
                continue
            log.close()
            del running[job]
            record = {"job": job, "tag": args.tag, "wall_s": time.time() - started,
                      "cpu_s": usage.ru_utime + usage.ru_stime,
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


def prepare_families(args: argparse.Namespace, root: Path, families: list[str]) -> dict[str, dict]:
    """Data and SFT of every family in this process (LLaMA-Factory lives in the main environment), timed once."""
    import resource

    os.environ.setdefault("OMP_NUM_THREADS", "2")  # LLaMA-Factory's SFT gets both cores
    times = {}
    for family in families:
        start, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        cfg = load(args, family)
        _, _, sft = prepare(cfg, root)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        path = root / f"sft_time-{family}.json"  # the first (uncached) preparation's cost, kept for later reports
        if not path.is_file():
            path.write_text(json.dumps({"wall_s": time.time() - start, "load": os.getloadavg()[0],
                                        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime +
                                                                                      before.ru_stime)}))
        times[family] = {**json.loads(path.read_text()),
                         "train_runtime_s": sft.meta.get("metrics", {}).get("train_runtime")}
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args, args.worker)
        return 0
    from learning_report import report

    root = Path(args.root).resolve()
    args.root = str(root)
    root.mkdir(parents=True, exist_ok=True)
    families, seeds = args.families.split(","), args.seeds.split(",")
    start = time.time()
    sft_times = prepare_families(args, root, families)
    # seed-major: a bench cut short still has whole seeds of every family and algorithm
    jobs = [f"{f}/sft" for f in families] + [f"{f}/{a}:{s}" for s in seeds for f in families
                                             for a in args.algos.split(",")]
    baselines = [] if args.no_sft_steps else [f"{f}/sftsteps:{s}" for s in seeds for f in families]
    done = [job for job in jobs + baselines if result_path(root, job, args.tag).is_file()]
    todo = [job for job in jobs + baselines if job not in done]
    pool = run_pool(args, todo, root) if todo else {"attempts": {}, "mean_load": os.getloadavg()[0]}
    missing = [job for job in jobs + baselines if not result_path(root, job, args.tag).is_file()]
    attempts = [a for a in read_attempts(root) if a.get("tag", "") == args.tag]
    for family in families:
        ours = [job for job in jobs if job.startswith(f"{family}/") and job not in missing]
        results = {job.partition("/")[2]: json.loads(result_path(root, job, args.tag).read_text()) for job in ours}
        steps = [json.loads(result_path(root, job, args.tag).read_text()) for job in baselines
                 if job.startswith(f"{family}/") and job not in missing]
        timing = {"sft": sft_times[family], "bench_wall_s": time.time() - start, "mean_load": pool["mean_load"],
                  "attempts": [{**a, "job": a["job"].partition("/")[2]} for a in attempts
                               if a["job"].startswith(f"{family}/")]}
        png = report(results, timing, root, [m for m in missing if m.startswith(f"{family}/")], family,
                     name=run_name(family, args.tag), baselines=steps)
        if args.png_dir and png:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, Path(args.png_dir) / png.name)
    print(f"\nbench: {(time.time() - start) / 60:.1f} min wall this invocation, mean load average "
          f"{pool['mean_load']:.1f} on {os.cpu_count()} cores")
    if missing:
        print(f"not finished: {', '.join(missing)}; rerun the same command to continue them")
    elif root == Path(parse_args([]).root).resolve():  # the experiment, not a smoke run into another root
        record(args, root, families, (time.time() - start) / 60 if todo else None)
    return 1 if missing else 0


def run_name(family: str, tag: str) -> str:
    return f"{family}@{tag}" if tag else family


def read_attempts(root: Path) -> list[dict]:
    path = root / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def record(args: argparse.Namespace, root: Path, families: list[str], minutes: float | None) -> None:
    """Held-out accuracy per family and policy, the printed tables and every run's per-step metrics, as
    bench/results/learning.json (learning-<tag>.json for a tag). `minutes` None: this invocation ran nothing (a
    report of finished runs), so the bench time of the invocation that ran them is kept."""
    from learning_report import step_table

    from bench.results import RESULTS_DIR

    record_name = "learning" + (f"-{args.tag}" if args.tag else "")
    earlier = RESULTS_DIR / f"{record_name}.json"
    if minutes is None and earlier.is_file():
        minutes = json.loads(earlier.read_text())["figures"].get("bench_min_this_invocation")
    figures: dict[str, float] = {"bench_min_this_invocation": round(minutes or 0.0, 1)}
    tables, parts = {}, []
    for family in families:
        name = run_name(family, args.tag)
        summary = json.loads((root / f"summary-{name}.json").read_text())
        sft = json.loads(result_path(root, f"{family}/sft").read_text())
        figures[f"{family}_sft"] = sft["heldout"]["accuracy"]
        for algo, s in summary["summaries"].items():
            figures[f"{family}_{algo}"] = round(s["accuracy"]["mean"], 4)
            figures[f"{family}_{algo}_gain"] = round(s["gain"]["mean"], 4)
        parts.append(f"`{family}`: SFT {{{family}_sft:.2f}} -> " + ", ".join(
            f"{algo.upper()} {{{family}_{algo}:.2f}}" for algo in summary["summaries"]))
        columns = list(summary["table"][0])
        tables[family] = {"columns": columns, "rows": [[row[c] for c in columns] for row in summary["table"]]}
        for key in ("seed_gain", "steps_vs_sft", "claims"):
            if summary.get(key) and summary[key].get("rows", True):
                tables[f"{family}-{key.replace('_', '-')}"] = summary[key]
        runs = [json.loads(path.read_text()) for path in sorted(result_path(root, f"{family}/x:0", args.tag)
                                                                   .parent.glob("*-s*.json"))]
        tables[f"{family}-steps"] = step_table([r for r in runs if r.get("algorithm") in args.algos.split(",")])
    label = f" ({args.tag}: {' '.join(args.override)})" if args.tag else ""
    figures, tables, parts = keep_other_families(record_name, families, figures, tables, parts)
    write_result(record_name, figures,
                 summary="held-out accuracy" + label + ", " + "; ".join(parts),
                 what="does RL learn, does ARPO beat GRPO: GRPO / ARPO / AEPO from one SFT policy, held-out accuracy "
                      "with paired intervals" + (f"; variant {args.tag}" if args.tag else ""),
                 command="bench/bench_learning.py",  # a variant's --tag and -o overrides: conditions
                 details="#does-rl-learn-grpo-arpo-and-aepo-measured-benchbench_learningpy",
                 conditions={"families": sorted({t.split("-")[0] for t in tables}), "algorithms": args.algos.split(","),
                             "seeds": args.seeds.split(","),
                             "steps": args.steps, "questions": args.questions, "samples": args.samples,
                             "sft_samples": args.sft_samples, "temperature": args.temperature,
                             "backend": args.backend, "jobs": args.jobs, "tag": args.tag,
                             "overrides": args.override},
                 tables=tables)


def keep_other_families(name: str, families: list[str], figures: dict, tables: dict,
                        parts: list[str]) -> tuple[dict, dict, list[str]]:
    """A bench run over some families keeps what an earlier run recorded for the others in the same result file."""
    from bench.results import RESULTS_DIR

    path = RESULTS_DIR / f"{name}.json"
    if not path.is_file():
        return figures, tables, parts
    old = json.loads(path.read_text())
    others = [f for f in FAMILIES if f not in families and f"{f}_sft" in old["figures"]]
    kept_figures = {k: v for k, v in old["figures"].items() if k.split("_")[0] in others}
    kept_tables = {k: v for k, v in old.get("tables", {}).items() if k.split("-")[0] in others}
    kept_parts = [p for p in old["summary"].partition(", ")[2].split("; ") if p.strip("`").split("`")[0] in others]
    return {**kept_figures, **figures}, {**kept_tables, **tables}, kept_parts + parts


if __name__ == "__main__":
    raise SystemExit(main())
