"""The tiny chain as a user meets it, from a fresh clone: `./scripts/run-tiny.sh` cold, the same command fully cached,
and a fully cached `arpo run` alone (the Prefect server already up), each by wall clock; the cold run's steps from
its task runs. Writes bench/results/tiny_chain.json (docs/benchmarks.md, "The tiny chain").

    flock /tmp/arpo-heavy.lock .venv/bin/python bench/bench_tiny_chain.py [--reruns 2] [--commit HEAD] [--keep]
        [-o KEY=VALUE ...]     # overrides for every run (recorded with the result)

The clone (`git clone` of the commit into a temp folder) has no outputs, no .cache and no .prefect, so the cold run
bootstraps the model (the GGUF wheel fetched and converted), trains, serves and evaluates; the environments are this
checkout's (`.venv`, `.venv-vllm` linked into the clone, with PYTHONPATH pointing at the clone so its code is the
code that runs; their install stamps make the set-up step a check: the bench refuses to start when a stamp is not
the cloned commit's, since the clone's set-up would then install into this checkout's environments, pointing their
editable install at the clone). The clone's Prefect server gets a free port of
its own (its prefect.toml is rewritten to it), so a server this checkout runs is not shared. A cached command's
start-up is the time until `arpo run` prints its `profile ...:` line, just before the flow's first line: the
interpreter, the imports (Prefect's included), the config and the one pre-flight. Run it on a quiet box: the load
average at each step is recorded with the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from flows.server import toml_on_port  # noqa: E402

PROJECT_ROOT = Path(__file__).resolve().parents[1]
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


def timed(cmd: list[str], clone: Path, log: Path) -> dict[str, float | None]:
    """Run `cmd` in the clone; its wall time, when it printed the flow-start line, and the load average before."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    flow_start = None
    with open(log, "a") as out, subprocess.Popen(cmd, cwd=clone, env=clone_env(clone), stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            if flow_start is None and line.startswith(FLOW_START):
                flow_start = time.perf_counter() - start
            out.write(line)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log}")
    return {"wall_s": round(wall, 1), "startup_s": None if flow_start is None else round(flow_start, 1),
            "load": round(load, 2)}


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
        tiny = [timed(["./scripts/run-tiny.sh", *extra], clone, log) for _ in range(args.reruns)]
        print(f"cached run-tiny.sh: {tiny}", flush=True)
        run = [timed([".venv/bin/arpo", "run", *extra], clone, log) for _ in range(args.reruns)]
        print(f"cached arpo run: {run}", flush=True)
        rows = step_rows(port)
    finally:
        subprocess.run([".venv/bin/arpo", "server", "stop"], cwd=clone, env=clone_env(clone), capture_output=True)
        if not args.keep:
            shutil.rmtree(parent, ignore_errors=True)
    rows += [["whole command, cold", f"{cold['wall_s']:.0f}"],
             ["whole command, fully cached", ", ".join(f"{r['wall_s']:.1f}" for r in tiny)],
             ["`arpo run` alone, fully cached (server up)", ", ".join(f"{r['wall_s']:.1f}" for r in run)],
             ["... of which before the flow starts", ", ".join(f"{r['startup_s']:.1f}" for r in run)]]
    write_result("tiny_chain", {"cold_s": cold["wall_s"], "cached_rerun_s": [r["wall_s"] for r in tiny],
                                "cached_arpo_run_s": [r["wall_s"] for r in run],
                                "cached_startup_s": [r["startup_s"] for r in run]},
                 summary="cold {cold_s:.0f} s; fully cached: run-tiny.sh {cached_rerun_s[0]:.1f} s, `arpo run` "
                         "alone {cached_arpo_run_s[0]:.1f} s ({cached_startup_s[0]:.1f} s of it before the flow)",
                 what="the whole tiny chain as a user runs it (profile `tiny-cpu`, vLLM serving), from a fresh clone: "
                      "`./scripts/run-tiny.sh` cold and fully cached, and a fully cached `arpo run` alone",
                 command="bench/bench_tiny_chain.py",
                 details="#the-tiny-chain-scriptsrun-tinysh",
                 conditions={"profile": "tiny-cpu", "overrides": args.override, "clone_of": commit,
                             "checkout": "a fresh clone of the commit: no outputs, no .cache, no .prefect; this "
                                         "checkout's environments linked in",
                             "timing": "wall clock of each command; start-up = until `arpo run` prints its profile "
                                       "line (just before the flow)",
                             "load_average_before": {"cold": cold["load"], "run-tiny.sh": [r["load"] for r in tiny],
                                                     "arpo run": [r["load"] for r in run]}},
                 tables={"stages": {"columns": ["step", "seconds"], "rows": rows}})


if __name__ == "__main__":
    main()
