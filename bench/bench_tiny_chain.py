"""The tiny chain as a user meets it, from a fresh clone: cold, then fully cached with and without a server up.

`./scripts/run-tiny.sh` cold, then fully cached in each case a user meets: the first run after the cold one, later
ones with the Prefect server up (run-tiny.sh and `arpo run` alone), and with no server up (`arpo run` alone, which
starts a temporary server, and run-tiny.sh, which starts the project's first); each by wall clock with where its
time goes, from the time each output line arrives; the cold run's steps from its task runs; and mlflow's import and
store open alone (the tracker, on by default). Writes bench/results/tiny_chain.json (docs/benchmarks.md, "The tiny
chain").

    flock /tmp/arpo-heavy.lock .venv/bin/python bench/bench_tiny_chain.py [--reruns 2] [--commit HEAD] [--keep]
        [-o KEY=VALUE ...]     # overrides for every run (recorded with the result)

The clone (`git clone` of the commit into a temp folder) has no outputs, no .cache and no .prefect, so the cold run
bootstraps the model (the GGUF wheel fetched and converted), trains, serves and evaluates; the environments are this
checkout's (`.venv`, `.venv-vllm` linked into the clone, with PYTHONPATH pointing at the clone so its code is the
code that runs; their install stamps make the set-up step a check: the bench refuses to start when a stamp is not
the cloned commit's, since the clone's set-up would then install into this checkout's environments, pointing their
editable install at the clone). The clone's Prefect server gets a free port of its own (its prefect.toml is
rewritten to it), so a server this checkout runs is not shared.

Where a cached command's time goes (`phases`, seconds from its start, read off its output): `setup_and_server`
until run-tiny.sh's `arpo server start` printed its line; `before_flow` until `arpo run` prints its `profile ...:`
line, just before the flow (the interpreter, the imports, the config, the pre-flight and, with no server up, the
wait for the temporary one); `flow_start` until Prefect's "Beginning flow run"; `tracker` the record-config task
(the run folder and the tracker's parent run: mlflow's import and store open, the resolved config as params);
`stages` until the run-summary task finished (the cost plan, every stage's cache lookup, the summary with the
tracker's links to the runs that computed the cached stages); `flow_end` until the flow's final state (Prefect joins
its heartbeat thread, which wakes once a second); `exit` from the last line to the process's end (exit hooks: the
log and event flush, the temporary server's stop; the interpreter's exit). `seams` is set when the run's pre-flight
ran the seam checks rather than finding their pass remembered. Run it on a quiet box: the load average at each step
is recorded with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from flows.server import toml_on_port  # noqa: E402
from stages.core.env import PROJECT_ROOT  # noqa: E402

ENVIRONMENTS = (".venv", ".venv-vllm")
FLOW_START = "profile "  # `arpo run` prints "profile <name>: <stages>" right before it calls the flow
# the cold run's steps, from its task runs' names (a name's prefix: what it belongs to)
STEPS = (("data + bootstrap (GGUF wheel -> HF folder)", ("data", "bootstrap")), ("sft (+ dpo)", ("sft", "dpo")),
         ("rl", ("rl",)), ("merge (with the parity probe)", ("merge",)), ("heldout (each policy)", ("heldout",)),
         ("vLLM server start", ("serve-",)), ("infer + score + report", ("infer", "score", "report")))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_clone(commit: str, parent: Path) -> tuple[Path, int]:
    """A fresh clone of `commit` with this checkout's environments linked in and a Prefect port of its own."""
    clone = parent / "arpo-pipeline"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(PROJECT_ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", commit], check=True)
    for name in ENVIRONMENTS:
        if (PROJECT_ROOT / name).exists():
            (clone / name).symlink_to(PROJECT_ROOT / name)
    port = free_port()
    toml = clone / "prefect.toml"
    toml.write_text(toml_on_port(toml.read_text(), port))
    return clone, port


def stale_environments(clone: Path) -> list[str]:
    """The linked environments whose install stamp is not the one the clone's set-up scripts would look for (each
    script's own `stamp=` line, evaluated in the clone), so its set-up would reinstall into them."""
    stale = []
    for script, venv in (("scripts/setup.sh", ".venv"), ("scripts/setup-vllm.sh", ".venv-vllm")):
        line = next(x for x in (clone / script).read_text().splitlines() if x.startswith("stamp="))
        flavor = os.environ.get("ARPO_VLLM_FLAVOR", "cpu")  # setup-vllm.sh's default off a GPU box
        stamp = subprocess.run(["bash", "-c", f'VENV={venv}; flavor={flavor}; {line}; echo "$stamp"'], cwd=clone,
                               capture_output=True, text=True, check=True).stdout.strip()
        if (PROJECT_ROOT / venv).exists() and not (PROJECT_ROOT / stamp).exists():
            stale.append(f"{venv} (no {stamp})")
    return stale


def clone_env(clone: Path) -> dict[str, str]:
    """This process's environment without anything that points Prefect or the project elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "ARPO_", "HF_", "VIRTUAL_ENV"))}
    return {**env, "PYTHONPATH": str(clone)}


# (phase mark, the output line that sets it: first occurrence, or the last one for flow_done)
MARKS = (("setup_and_server", lambda line: line.startswith("Prefect UI: ")),
         ("seams", lambda line: "seam checks passed" in line),
         ("before_flow", lambda line: line.startswith(FLOW_START)),
         ("flow_start", lambda line: "Beginning flow run" in line),
         ("tracker", lambda line: "Task run 'record-config" in line and "Finished in state" in line),
         ("stages", lambda line: "Task run 'run-summary" in line and "Finished in state" in line),
         ("flow_end", lambda line: "Flow run '" in line and "Finished in state" in line))


def phases(marks: dict[str, float], last_line: float, wall: float) -> dict[str, float]:
    """Seconds spent in each phase (module docstring), from the times its marking lines arrived."""
    out, previous = {}, 0.0
    for name, _ in MARKS:
        if name in marks and name != "seams":
            out[name] = round(marks[name] - previous, 2)
            previous = marks[name]
    out["exit"] = round(wall - max(last_line, previous), 2)
    return out


def timed(cmd: list[str], clone: Path, log: Path) -> dict[str, Any]:
    """Run `cmd` in the clone: its wall time, where it went (`phases`), the CPU of its processes that exited with it
    (a temporary server's and a started `arpo server`'s not included) and the load average before."""
    load = os.getloadavg()[0]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    marks: dict[str, float] = {}
    last_line = 0.0
    with open(log, "a") as out, subprocess.Popen(cmd, cwd=clone, env=clone_env(clone), stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True) as proc:
        out.write(f"$ {' '.join(cmd)}\n")
        for line in proc.stdout:
            last_line = time.perf_counter() - start
            for name, test in MARKS:
                if (name not in marks or name == "flow_end") and test(line):
                    marks[name] = last_line
            out.write(line)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    return {"wall_s": round(wall, 1), "startup_s": round(marks["before_flow"], 1) if "before_flow" in marks else None,
            "cpu_s": round(used, 1), "load": round(load, 2), "seams": "seams" in marks,
            "phases": phases(marks, last_line, wall)}


MLFLOW_OPEN = """
import json, sys, time
wall, cpu = time.perf_counter(), time.process_time()
import prefect  # imported before the tracker in a run: not counted
t0, c0 = time.perf_counter(), time.process_time()
from mlflow import MlflowClient
import mlflow.store.tracking.sqlalchemy_store
t1, c1 = time.perf_counter(), time.process_time()
MlflowClient(tracking_uri=sys.argv[1]).get_experiment_by_name(sys.argv[2])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"import_s": round(t1 - t0, 2), "import_cpu_s": round(c1 - c0, 2), "open_s": round(t2 - t1, 2),
                  "open_cpu_s": round(c2 - c1, 2)}))
"""


def mlflow_open(clone: Path) -> dict[str, Any]:
    """mlflow's import and the open of the run's local store (outputs/mlflow/mlflow.db, made by the cold run), alone
    in a fresh interpreter of the clone's: what the tracker's parent run costs a cached run before its first call."""
    uri = f"sqlite:///{clone / 'outputs' / 'mlflow' / 'mlflow.db'}"
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, "-c", MLFLOW_OPEN, uri, "arpo-tiny-cpu"], cwd=clone, env=clone_env(clone),
                          capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": round(load, 2)}


def stop_server(clone: Path) -> None:
    subprocess.run([".venv/bin/arpo", "server", "stop"], cwd=clone, env=clone_env(clone), capture_output=True)


def step_rows(port: int) -> list[list[str]]:
    """The newest flow run's task runs on the clone's server, summed into the steps of STEPS (seconds)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_ASC)
            first = next(r for r in runs if r.parent_task_run_id is None)  # the cold run (evaluate is its subflow)
            ids = [first.id] + [r.id for r in runs if r.parent_task_run_id is not None and r.start_time
                                and first.end_time and first.start_time <= r.start_time <= first.end_time]
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    seconds = {label: 0.0 for label, _ in STEPS}
    for task in tasks:
        for label, prefixes in STEPS:
            if task.name.startswith(prefixes) and task.total_run_time:
                seconds[label] += task.total_run_time.total_seconds()
                break
    return [[label, f"{value:.0f}"] for label, value in seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="HEAD", help="the commit to clone (default: this checkout's HEAD)")
    parser.add_argument("--reruns", type=int, default=2, help="fully cached reruns of each command")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (arpo run -o), recorded with the result")
    args = parser.parse_args()
    parent = Path(tempfile.mkdtemp(prefix="arpo-tiny-chain-"))
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=PROJECT_ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    clone, port = make_clone(commit, parent)
    stale = stale_environments(clone)
    if stale:
        shutil.rmtree(parent, ignore_errors=True)
        raise SystemExit(f"the environments are not installed for {commit}: {', '.join(stale)}. Run ./scripts/setup.sh "
                         "in this checkout (at that commit) first: the clone's set-up would install into them")
    log = parent / "runs.log"
    print(f"clone: {clone} (Prefect port {port}); output: {log}", flush=True)
    try:
        extra = [arg for override in args.override for arg in ("-o", override)]
        cold = timed(["./scripts/run-tiny.sh", *extra], clone, log)
        print(f"cold run-tiny.sh: {cold}", flush=True)
        # fully cached, the server up (the cold run started it); the first is the first run after the cold one
        tiny = [timed(["./scripts/run-tiny.sh", *extra], clone, log) for _ in range(args.reruns)]
        print(f"cached run-tiny.sh: {tiny}", flush=True)
        run = [timed([".venv/bin/arpo", "run", *extra], clone, log) for _ in range(args.reruns)]
        print(f"cached arpo run: {run}", flush=True)
        tracker = [mlflow_open(clone) for _ in range(args.reruns)]
        print(f"mlflow import + store open: {tracker}", flush=True)
        rows = step_rows(port)
        # no server up: `arpo run` starts a temporary one (the first of a Prefect version migrates its database, the
        # later ones start from a copy of it); run-tiny.sh starts the project's, stopped again before each
        stop_server(clone)
        alone = [timed([".venv/bin/arpo", "run", *extra], clone, log) for _ in range(args.reruns)]
        print(f"cached arpo run, no server: {alone}", flush=True)
        down = []
        for _ in range(args.reruns):
            stop_server(clone)
            down.append(timed(["./scripts/run-tiny.sh", *extra], clone, log))
        print(f"cached run-tiny.sh, server down: {down}", flush=True)
    finally:
        stop_server(clone)
        if not args.keep:
            shutil.rmtree(parent, ignore_errors=True)

    def each(results: list[dict[str, Any]], key: str, phase: bool = False) -> str:
        return ", ".join(f"{(r['phases'] if phase else r).get(key, 0):.1f}" for r in results)

    rows += [["whole command, cold", f"{cold['wall_s']:.0f}"],
             ["whole command, fully cached (the first right after the cold run)", each(tiny, "wall_s")],
             ["... of which before the flow starts (set-up check and `arpo server start` included)",
              each(tiny, "before_flow", True)],
             ["`arpo run` alone, fully cached (server up)", each(run, "wall_s")],
             ["... of which before the flow starts", each(run, "before_flow", True)],
             ["... of which the tracker's parent run (record-config)", each(run, "tracker", True)],
             ["... of which the stages' cache lookups and the run summary", each(run, "stages", True)],
             ["... of which the flow's end and the process's exit",
              ", ".join(f"{r['phases'].get('flow_end', 0) + r['phases']['exit']:.1f}" for r in run)],
             ["mlflow import + store open, alone (CPU s)",
              ", ".join(f"{t['import_cpu_s'] + t['open_cpu_s']:.1f}" for t in tracker)],
             ["`arpo run` alone, fully cached, no server (a temporary one)", each(alone, "wall_s")],
             ["... of which before the flow starts (the temporary server's start)", each(alone, "before_flow", True)],
             ["run-tiny.sh, fully cached, server down (it starts it)", each(down, "wall_s")],
             ["... of which the set-up check and `arpo server start`", each(down, "setup_and_server", True)]]
    write_result("tiny_chain", {"cold_s": cold["wall_s"], "cached_rerun_s": [r["wall_s"] for r in tiny],
                                "cached_arpo_run_s": [r["wall_s"] for r in run],
                                "cached_startup_s": [r["startup_s"] for r in run],
                                "no_server_arpo_run_s": [r["wall_s"] for r in alone],
                                "server_down_rerun_s": [r["wall_s"] for r in down],
                                "mlflow_open_cpu_s": [round(t["import_cpu_s"] + t["open_cpu_s"], 2) for t in tracker],
                                "phases": {"run-tiny.sh": [r["phases"] for r in tiny],
                                           "arpo run": [r["phases"] for r in run],
                                           "arpo run, no server": [r["phases"] for r in alone],
                                           "run-tiny.sh, server down": [r["phases"] for r in down]},
                                "cpu_s": {"run-tiny.sh": [r["cpu_s"] for r in tiny], "arpo run": [r["cpu_s"] for r in run],
                                          "arpo run, no server": [r["cpu_s"] for r in alone],
                                          "run-tiny.sh, server down": [r["cpu_s"] for r in down]},
                                "seam_checks_ran": {"run-tiny.sh": [r["seams"] for r in tiny],
                                                    "arpo run": [r["seams"] for r in run]},
                                "mlflow_open": tracker},
                 summary="cold {cold_s:.0f} s; fully cached: run-tiny.sh {cached_rerun_s[0]:.1f} s right after it, "
                         "`arpo run` alone {cached_arpo_run_s[0]:.1f} s ({cached_startup_s[0]:.1f} s of it before the "
                         "flow); no server up: `arpo run` {no_server_arpo_run_s[0]:.1f} s, run-tiny.sh "
                         "{server_down_rerun_s[0]:.1f} s",
                 what="the whole tiny chain as a user runs it (profile `tiny-cpu`, vLLM serving), from a fresh clone: "
                      "`./scripts/run-tiny.sh` cold and fully cached, a fully cached `arpo run` alone, each with the "
                      "Prefect server up and without one",
                 command="bench/bench_tiny_chain.py",
                 details="#the-tiny-chain-scriptsrun-tinysh",
                 conditions={"profile": "tiny-cpu", "overrides": args.override, "clone_of": commit,
                             "checkout": "a fresh clone of the commit: no outputs, no .cache, no .prefect; this "
                                         "checkout's environments linked in",
                             "timing": "wall clock of each command; its phases from the time its output lines arrive "
                                       "(bench/bench_tiny_chain.py's docstring); start-up = until `arpo run` prints "
                                       "its profile line (just before the flow)",
                             "load_average_before": {"cold": cold["load"], "run-tiny.sh": [r["load"] for r in tiny],
                                                     "arpo run": [r["load"] for r in run],
                                                     "mlflow open": [t["load"] for t in tracker],
                                                     "arpo run, no server": [r["load"] for r in alone],
                                                     "run-tiny.sh, server down": [r["load"] for r in down]}},
                 tables={"stages": {"columns": ["step", "seconds"], "rows": rows}})

if __name__ == "__main__":
    main()
