"""The learning bench's pool: each job (bench/learning_jobs.py) in its own process, `args.jobs` at a time, started
by the project's process manager (stages.core.procs.launch: its own process group, its output appended to its log);
per attempt its wall and CPU time (os.wait4: the CPU of the worker and of the evaluation it execs into) and the load
average, appended to `<root>/attempts.jsonl`. A job past `args.run_timeout` is asked to stop (SIGTERM: it unwinds,
and resumes from its last RL checkpoint the next time) and restarted up to `args.retries` times; an interrupted
pool stops every group it started.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from bench.learning_jobs import Job
from stages.core.procs import launch, stop_group

POLL_S = 5.0


def worker_env(project_root: Path) -> dict[str, str]:
    """One torch thread per worker (`args.jobs` of them share the box), and vLLM's CPU backend kept small."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(project_root),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}


def run_pool(args: argparse.Namespace, jobs: list[Job], root: Path, command: Sequence[str], env: dict[str, str],
             poll_s: float = POLL_S) -> dict:
    """Run `jobs`; a job's process is `[*command, "--worker", str(job)]`. Returns every attempt per job and the
    mean load average."""
    attempts: dict[Job, list[dict]] = {job: [] for job in jobs}
    pending, running = list(jobs), {}
    loads: list[float] = []
    (root / "logs").mkdir(parents=True, exist_ok=True)
    try:
        _pool_loop(args, root, list(command), env, attempts, pending, running, loads, poll_s)
    except BaseException:  # interrupted: no worker outlives the pool (each resumes from its checkpoint next time)
        for proc, *_ in running.values():
            stop_group(proc.pid, grace_s=30.0, proc=proc)
        raise
    return {"attempts": attempts, "mean_load": sum(loads) / len(loads) if loads else os.getloadavg()[0]}


def _pool_loop(args: argparse.Namespace, root: Path, command: list[str], env: dict[str, str],
               attempts: dict[Job, list[dict]], pending: list[Job], running: dict, loads: list[float],
               poll_s: float) -> None:
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            proc = launch([*command, "--worker", str(job)], root / "logs" / f"{job.log_name(args.tag)}.log", env,
                          supervised=False)
            running[job] = (proc, time.time(), os.getloadavg()[0])
            print(f"[{time.strftime('%H:%M:%S')}] started {job}", flush=True)
        time.sleep(poll_s)
        loads.append(os.getloadavg()[0])
        for job, (proc, started, load0) in list(running.items()):
            timed_out = time.time() - started > args.run_timeout
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # not Popen.poll: wait4 also gives the CPU time
            if pid == 0:
                if timed_out:
                    proc.terminate()  # reaped on the next pass; the run resumes from its checkpoint next time
                continue
            del running[job]
            record = {"job": str(job), "tag": args.tag, "split": args.split, "wall_s": time.time() - started,
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
