"""Does RL learn, does ARPO beat GRPO? GRPO vs ARPO vs AEPO from one shared SFT policy per task family, under the
protocol written before the confirmatory run (docs/learning.md: v1 as run; v2 with content accuracy and the
format-only arm, `--format-seeds`).

    .venv/bin/python bench/bench_learning.py                       # the confirmatory run (resumable: rerun it)
    .venv/bin/python bench/bench_learning.py --split rl_valid --families arith --algos grpo --seeds 0,1 \
        --tag lr1e-5 -o rl.optim.lr=1e-5                           # one point of a setting's sweep: validation only
    .venv/bin/python bench/bench_learning.py --families arith --seeds 0 --algos grpo --steps 1 \
        --questions 8 --root /tmp/x --allow-dirty                   # smoke

Task families (settings: bench/learning-<family>.yaml, which extends bench/learning.yaml, which extends tiny-cpu;
SmolLM2-135M-Instruct): `arith` (products of two 3-digit numbers, one <python> call) and `chain` (a search over
the generated corpus, then python on the year it returned: two dependent calls). Per family the SFT policy is
trained once (LLaMA-Factory, cached); every (algorithm, seed) run trains from it with the same rollout budget, and
the lr = 0 control (GRPO at rl.optim.lr=0) goes through the same RL -> save -> reload -> evaluate path. Every
policy is evaluated on one split (`--split`: the 400-question test split for the confirmatory run, the validation
split for every choice of a setting) with its run's seed as the sampling seed; SFT once per seed, paired with the
RL runs of that seed. Each run is its own process (`--jobs` at a time, one torch thread each; under `--python`,
vLLM's interpreter by default, with `--backend vllm` rollouts and held-out generation) under a wall-clock limit
(`--run-timeout`); a run cut off there, or by a crash, continues from its last RL checkpoint the next time the bench
runs, and a finished run's results file (`<root>/results/<family>[-valid][@<tag>]/<run>-s<seed>.json`) is reused.

Printed per family: the descriptive table (accuracy, gains, reward and training accuracy early vs late, tool calls,
branches, format errors, alarms), per-step metrics and a plot (`<root>/learning-<family>.png`). When every run is
done the record is written (bench/learning_record.py): bench/results/learning[-valid][-<tag>].json with the
protocol's endpoints (bench/learning_stats.py) and its per-question file (bench/results/per-question/), from the
commit the invocation started on; a checkout with uncommitted changes is refused (run from a clean worktree).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.learning_jobs import SFT, SFT_STEPS, Job, algorithm_of, arm_overrides, job_lists, result_path
from stages.core.algorithm_spec import SPECS as ALGORITHM_SPECS
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

BENCH = Path(__file__).resolve().parent
FAMILIES = ("arith", "chain")
ALGOS = tuple(spec.name for spec in ALGORITHM_SPECS)   # the algorithm table, in its order
BASELINE = next(spec.name for spec in ALGORITHM_SPECS if not spec.branches)  # independent samples: GRPO
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
SPLITS = ("eval_test", "rl_valid")
STEP_KEYS = ("step", "reward/mean", "accuracy", "entropy/mean", "tools/calls_per_traj",
             "rollout/tool_calls_executed_per_traj", "rollout/branches_per_group", "rollout/fresh_per_group",
             "reward/groups_without_signal", "reward/format_error_rate", "advantage/mean_abs", "clip_fraction",
             "ppo_kl", "grad_norm", "rollout/logp_mismatch", "response/length", "finish/length", "timing/step_s",
             "timing/rollout_s",
             "timing/old_logprob_s", "timing/update_s", "timing/step_cpu_s", "alarm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--algos", default=",".join(ALGOS), help="RL algorithms; empty: SFT's evaluations only")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="the protocol's design: 5 seeds (docs/learning.md)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: learning.yaml)")
    parser.add_argument("--split", choices=SPLITS, default="eval_test",
                        help="where the policies are evaluated: eval_test (the held-out test split: the protocol's "
                             "confirmatory run) or rl_valid (the validation split: every choice of a setting)")
    parser.add_argument("--questions", type=int, default=None, help="the first N questions of the split (all)")
    parser.add_argument("--samples", type=int, default=1,
                        help="samples per question, for every policy; SFT is evaluated once per seed, with that "
                             "seed as its sampling seed, as each RL run is (docs/learning.md, the protocol)")
    parser.add_argument("--control-seeds", default="0",
                        help="seeds of the lr = 0 control (GRPO with rl.optim.lr=0 through the same RL -> save -> "
                             "reload -> evaluate path); empty: none")
    parser.add_argument("--format-seeds", default="",
                        help="seeds of the format-only arm (GRPO with rl.trainer.reward=format_only: the format "
                             "score alone, no correctness; protocol v2, docs/learning.md); empty: none")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on a checkout with uncommitted changes (its record then says so; the protocol's "
                             "records are made from a clean checkout)")
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
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a job: "<family>/<kind>:<seed>"
    parser.add_argument("--eval-only", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load(args: argparse.Namespace, family: str, algo: str = BASELINE):
    """The family's config for one run; `algo` may be an arm (learning_jobs.ARMS: the baseline algorithm with the
    arm's overrides) or SFT's job."""
    from stages.core.config.loader import load_config

    path = BENCH / f"learning-{family}.yaml"   # extends bench/learning.yaml, which extends tiny-cpu
    if not path.is_file():
        raise SystemExit(f"unknown task family {family!r}: no {path}; families: {', '.join(FAMILIES)}")
    steps = [f"rl.trainer.total_steps={args.steps}"] if args.steps else []
    return load_config(str(path), [f"rl.rollout.backend={args.backend}", *args.override, *steps,
                                   *arm_overrides(algo), f"rl.algorithm={algorithm_of(algo, BASELINE)}"])


def heldout_spec(args: argparse.Namespace, cfg, seed: int):
    """The evaluation of one run: its own seed is its sampling seed (runs share no evaluation noise)."""
    from stages.core.config.eval import HeldoutSection

    ro = cfg.rl.rollout
    return HeldoutSection(split=args.split, max_questions=args.questions, samples=args.samples,
                          temperature=args.temperature, max_response_length=ro.max_response_length,
                          max_prompt_length=ro.max_prompt_length, call_limit=ro.call_limit,
                          reward=cfg.rl.trainer.reward, questions_per_batch=40, backend=args.backend, seed=seed)


def prepare(cfg, root: Path):
    """Base model, task set and the family's SFT policy (each cached in `root`)."""
    from stages.bootstrap import bootstrap_model
    from stages.data import prepare_data
    from stages.sft import run_sft

    cache = str(PROJECT_ROOT / ".cache")
    model = bootstrap_model(cfg.model, root, cache)
    data = prepare_data(cfg.data, root)
    return model, data, run_sft(cfg.sft, cfg.agent, model, data, str(root), cache)


def changes_sft(args: argparse.Namespace) -> bool:
    """Does an override reach what the SFT policy or its evaluation depends on (not the RL sections alone)?"""
    return any(o.partition("=")[0].split(".")[0] in ("sft", "data", "model", "agent") for o in args.override)


def out_path(args: argparse.Namespace, job: Job) -> Path:
    return result_path(Path(args.root), job, args.tag, args.split, changes_sft(args))


# ---- one run (a worker process) ------------------------------------------------------------------------------
def worker(args: argparse.Namespace, job: Job) -> None:
    """RL (cached once done), then the held-out evaluation and the results file. With vLLM the evaluation runs in
    a fresh process image: a second in-process vLLM engine fails to start once the search tool has imported numba
    (vllm 0.32's kernel-override scan trips over llvmlite's wrappers), and the new image holds none of RL's memory."""
    import torch

    from stages.rl.stage import run_rl

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the time limit: unwind so tools and caches close
    cfg = load(args, job.family, job.kind)
    _, data, sft = prepare(cfg, Path(args.root))
    if job.kind == SFT_STEPS:
        from bench.learning_baseline import sft_step_rewards

        sft_step_rewards(cfg, sft, data, job.seed, out_path(args, job))
        return
    if job.trains and not args.eval_only:
        start = time.perf_counter()
        run_rl(cfg.rl, cfg.agent, sft, data, args.root, str(PROJECT_ROOT / ".cache"), seed=job.seed)
        out_path(args, job).parent.mkdir(parents=True, exist_ok=True)
        out_path(args, job).with_suffix(".rl_s").write_text(str(time.perf_counter() - start))
    if args.backend == "vllm" and not args.eval_only:
        hand_over_to_evaluation()
    evaluate(args, job, cfg, data, sft)


def hand_over_to_evaluation() -> None:
    """Replace this process with its `--eval-only` self (os.execv: same pid, so the pool's wait4 still counts the
    CPU of both halves and its terminate still reaches the evaluation). A child process would keep RL's 6-8 GB
    resident beside the evaluation's ~3 GB for the whole evaluation; exec gives it back first."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:], "--eval-only"])


def evaluate(args: argparse.Namespace, job: Job, cfg, data, sft) -> None:
    """Evaluate one run's policy (SFT's for `sft:<seed>`) with its seed as the sampling seed; write its results file:
    per question the correct, well-formed and content-correct sample counts and the tool calls (the protocols'
    endpoints; content: stages/eval/content.py, the eval stage's grader)."""
    from learning_report import advantage_sign_agreement

    from bench.learning_archive import reload_check
    from bench.results import commit_state
    from stages.core.atomic import read_jsonl, write_json
    from stages.heldout import evaluate_heldout
    from stages.rl.stage import run_rl

    root, cache = Path(args.root), str(PROJECT_ROOT / ".cache")
    policy, rows, signs, alarms = sft, [], {}, []
    if job.trains:
        policy = run_rl(cfg.rl, cfg.agent, sft, data, root, cache, seed=job.seed)  # done: the stage's marker
        stage = Path(policy.path).parents[1]
        rows = [{k: r.get(k) for k in STEP_KEYS} for r in read_jsonl(stage / "metrics.jsonl")]
        dumps = [row for path in sorted((stage / "rollouts").glob("step_*.jsonl")) for row in read_jsonl(path)]
        signs = advantage_sign_agreement(dumps)
        alarms = read_jsonl(stage / "alarms.jsonl") if (stage / "alarms.jsonl").is_file() else []
    scores = evaluate_heldout(heldout_spec(args, cfg, job.seed), cfg.agent, policy, data, root, cache)
    predictions = read_jsonl(Path(scores.path).with_name("predictions.jsonl"))
    content = [content_verdicts(p) for p in predictions]  # per answer, for the record's archive too
    reload = reload_check(policy) if job.trains else None  # the trainer's last step vs the policy as reloaded
    rl_s = out_path(args, job).with_suffix(".rl_s")
    write_json(out_path(args, job), {
        "job": str(job), "tag": args.tag, "family": job.family, "algorithm": job.kind, "seed": job.seed,
        "eval_seed": job.seed,
        "split": args.split, "samples": args.samples, "commit": commit_state()[0],
        "config": {"rl": cfg.rl.model_dump(mode="json"), "sft": cfg.sft.model_dump(mode="json")},
        "steps": rows, "alarms": alarms, "heldout": scores.meta, "heldout_path": scores.path,
        "correct_Q": [sum(p["correct"]) / len(p["correct"]) for p in predictions],
        "correct_count_Q": [sum(p["correct"]) for p in predictions],
        "formed_count_Q": [sum(p["format_ok"]) for p in predictions],
        "calls_Q": [sum(p["tool_calls"]) for p in predictions],
        "content_QN": content, "reload_check": reload,
        "content_count_Q": [sum(c) for c in content],
        "questions": [p["question"] for p in predictions],
        "rl_seconds_last_attempt": float(rl_s.read_text()) if rl_s.is_file() else None,
        "advantage_signs": signs, "policy": policy.path})
    if job.trains and not args.keep_optimizer:  # 1 GB per finished run; nothing resumes a finished run
        (Path(policy.path) / "optimizer.pt").unlink(missing_ok=True)


def content_verdicts(prediction: dict) -> list[bool]:
    """Per answer of a held-out question: is it right wherever the response gives it (stages/eval/content.py: the
    eval stage's grader, the task type from the row's ability)?"""
    from stages.eval.content import content_correct

    task_type = "math" if prediction.get("ability") == "math" else "qa"
    return [content_correct(response, prediction["answer"], task_type) for response in prediction["responses"]]


def prepare_families(args: argparse.Namespace, root: Path, families: list[str], build: bool = True) -> dict[str, dict]:
    """Data and SFT of every family in this process (LLaMA-Factory lives in the main environment), timed once.
    `build` False (every run is done: a report): nothing is built, so a report from a later commit, whose code
    versions key the stages anew, does not train SFT again; the first preparation's times are read back."""
    import resource

    os.environ.setdefault("OMP_NUM_THREADS", "2")  # LLaMA-Factory's SFT gets both cores
    times = {}
    for family in families:
        path = root / f"sft_time-{family}{f'@{args.tag}' if changes_sft(args) else ''}.json"
        if not build:
            times[family] = json.loads(path.read_text()) if path.is_file() else {}
            continue
        start, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        cfg = load(args, family)
        _, _, sft = prepare(cfg, root)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if not path.is_file():  # the first (uncached) preparation's cost, kept for later reports
            path.write_text(json.dumps({"wall_s": time.time() - start, "load": os.getloadavg()[0],
                                        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime +
                                                                                      before.ru_stime)}))
        times[family] = {**json.loads(path.read_text()),
                         "train_runtime_s": sft.meta.get("metrics", {}).get("train_runtime")}
    return times


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args, Job.parse(args.worker))
        return 0
    from learning_record import build_record, pinned_commit, record_invocation

    from bench.learning_pool import run_pool, worker_env
    from bench.results import commit_state, write_result

    root = Path(args.root).resolve()
    args.root = str(root)
    official = root == Path(parse_args([]).root).resolve()  # the experiment, not a smoke run into another root
    provenance = commit_state(ignore=("bench/results/",))  # its own records, written by earlier invocations
    if official and provenance[1] and not args.allow_dirty:
        raise SystemExit("error: the checkout has uncommitted changes, and a learning record must name the code it ran "
                         "(docs/learning.md, the protocol). Commit them, or run from a clean worktree "
                         "(git worktree add ../bench-wt HEAD), or pass --allow-dirty for a trial whose record says so.")
    root.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",")
    start = time.time()
    jobs, baselines = job_lists(args, families)
    todo = [job for job in jobs + baselines if not out_path(args, job).is_file()]
    if official and todo and (pinned := pinned_commit(root, args, provenance[0])):
        raise SystemExit(f"error: this record's runs started on commit {pinned}, and every run of a design comes from "
                         f"one commit; resume from a worktree there: git worktree add ../bench-wt {pinned}")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` or a session's end: still record this invocation (below)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        sft_times = prepare_families(args, root, families, build=bool(todo))
        pool = run_pool(args, todo, root, [args.python, __file__, *sys.argv[1:]], worker_env(PROJECT_ROOT)) if todo \
            else {"attempts": {}, "mean_load": os.getloadavg()[0]}
    except KeyboardInterrupt:  # its wall time and commit count toward the design (the pin, the bench's total)
        record_invocation(root, args, time.time() - start, ran=bool(todo), commit=provenance[0], interrupted=True)
        raise SystemExit("interrupted: finished runs are kept, a cut run resumes from its checkpoint; rerun the same "
                         "command to continue") from None
    missing = [job for job in jobs + baselines if not out_path(args, job).is_file()]
    record_invocation(root, args, time.time() - start, ran=bool(todo), commit=provenance[0])
    for family in families:
        report_family(args, root, family, jobs, baselines, missing, sft_times[family], pool, time.time() - start)
    print(f"\nbench: {(time.time() - start) / 60:.1f} min wall this invocation, mean load average "
          f"{pool['mean_load']:.1f} on {os.cpu_count()} cores")
    if missing:
        print(f"not finished: {', '.join(map(str, missing))}; rerun the same command to continue them")
    elif official:
        results = {f: {job.run: json.loads(out_path(args, job).read_text()) for job in jobs if job.family == f}
                   for f in families}
        summaries = {f: json.loads((root / f"summary-{run_name(f, args.tag, args.split)}.json").read_text())
                     for f in families}
        record = build_record(args, root, results, summaries)
        write_result(record.pop("name"), record.pop("figures"), command="bench/bench_learning.py",
                     provenance=provenance, **record)  # a variant's --split, --tag and -o overrides: conditions
    return 1 if missing else 0


def report_family(args: argparse.Namespace, root: Path, family: str, jobs: list[Job], baselines: list[Job],
                  missing: list[Job], sft_time: dict, pool: dict, wall_s: float) -> None:
    """The descriptive report of one family (learning_report: tables, plot, step table), SFT's seeds pooled."""
    from learning_record import pooled_sft
    from learning_report import report

    ours = [job for job in jobs if job.family == family and job not in missing]
    results = {job.run: json.loads(out_path(args, job).read_text()) for job in ours}
    sft_runs = [results.pop(job.run) for job in ours if job.kind == SFT]
    if sft_runs:
        results["sft"] = pooled_sft(sft_runs)
    steps = [json.loads(out_path(args, job).read_text()) for job in baselines
             if job.family == family and job not in missing]
    attempts = [a for a in read_attempts(root)
                if a.get("tag", "") == args.tag and a.get("split", "eval_test") == args.split]
    timing = {"sft": sft_time, "bench_wall_s": wall_s, "mean_load": pool["mean_load"],
              "attempts": [{**a, "kind": Job.parse(a["job"]).kind} for a in attempts
                           if Job.parse(a["job"]).family == family]}
    png = report(results, timing, root, [str(m) for m in missing if m.family == family], family,
                 name=run_name(family, args.tag, args.split), baselines=steps)
    if args.png_dir and png:
        Path(args.png_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, Path(args.png_dir) / png.name)


def run_name(family: str, tag: str, split: str = "eval_test") -> str:
    return family + ("-valid" if split == "rl_valid" else "") + (f"@{tag}" if tag else "")


def read_attempts(root: Path) -> list[dict]:
    path = root / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


if __name__ == "__main__":
    raise SystemExit(main())
