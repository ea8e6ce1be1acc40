"""The project as a new user meets it, from fresh shells (`env -i`: no PREFECT_* variable, an empty home):

- `arpo run` with no server running finishes on an ephemeral one, although prefect.toml names the project's server;
- the README's deployment commands reach the project's server through prefect.toml alone;
- a bad override fails the run once, with the config error as its message; a bad profile is refused by the
  deployment's parameter schema before any run exists;
- while RL runs, the web UI shows the stage's log lines and its progress artifact; the pipeline process is then
  killed with SIGKILL, the server's heartbeat automation marks the run Crashed, and the rerun's logs say RL resumed
  from its checkpoint.

Over 5 minutes, because it waits on real time: the server's crash automation needs three missed 30-second
heartbeats before it marks the killed run Crashed, and each fresh shell pays the CLI's imports; RL itself is two
tiny steps on the base model.

Everything runs in a copy of this checkout (its tracked and new files; the venv and .cache are shared) whose
prefect.toml differs only in the port (flows.server.toml_on_port), so the test's server never meets a developer's
server on the project's own port.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.automations import crash_silent_runs
from flows.server import toml_on_port
from stages.core.env import PROJECT_ROOT
from tests.conftest import TEST_OUTPUTS, module_scratch, require_chromium

pytestmark = [pytest.mark.slow, pytest.mark.integration]
VENV_BIN = Path(sys.executable).parent
# RL on the base model (no SFT), two short steps of one prompt x 2 trajectories, a checkpoint after each
ETA_LINE = "RL (arpo): 1/2 steps (50%)"
RL_RUN = ["--until", "rl", "-o", "sft.enabled=false", "-o", "rl.rollout.n=2", "-o", "rl.rollout.initial_rollouts=1",
          "-o", "rl.trainer.train_batch_size=1", "-o", "rl.trainer.ppo_mini_batch_size=1",
          "-o", "rl.trainer.micro_batch_size=2", "-o", "rl.rollout.max_response_length=48",
          "-o", "rl.rollout.call_limit=1", "-o", "rl.trainer.total_steps=2", "-o", "rl.trainer.save_every=1"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def readme_block(section: str) -> list[str]:
    """The commands of the first ```bash block after the README heading `section` (comments stripped)."""
    text = (PROJECT_ROOT / "README.md").read_text()
    block = text.split(f"### {section}", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def project(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model) -> dict:
    """A copy of this checkout whose prefect.toml points at a free port, and a fresh-shell runner inside it."""
    root = module_scratch(request, tmp_path_factory.mktemp("project")) / "arpo-pipeline"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=PROJECT_ROOT, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    for name in listed:
        source = PROJECT_ROOT / name
        if source.is_file() and not source.is_symlink():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    (root / ".venv").symlink_to(VENV_BIN.parent.resolve())
    (root / ".cache").symlink_to(PROJECT_ROOT / ".cache")
    (root / "outputs").mkdir()
    (root / "outputs" / "bootstrap").symlink_to(TEST_OUTPUTS / "bootstrap")  # the converted tiny model, reused
    port = _free_port()
    (root / "prefect.toml").write_text(toml_on_port((PROJECT_ROOT / "prefect.toml").read_text(), port))
    home = root.parent / "home"
    home.mkdir()

    def shell(command: str, timeout: float = 900, **popen: object) -> subprocess.CompletedProcess | subprocess.Popen:
        # A fresh login: no PREFECT_* variables, an empty home. PYTHONPATH only makes this copy's code win over the
        # shared venv's editable install (git worktrees share one venv); PATH is an activated venv's.
        env = ["env", "-i", f"HOME={home}", f"PATH={VENV_BIN}:/usr/bin:/bin", f"PYTHONPATH={root}", "LANG=C.UTF-8"]
        argv = [*env, "bash", "-c", command]
        if popen:
            return subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    **popen)
        return subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=timeout)

    info = {"root": root, "port": port, "url": f"http://127.0.0.1:{port}", "shell": shell}
    yield info
    shell("arpo worker stop; arpo server stop", timeout=120)
    for stage in ("data", "rl", "runs"):  # RL checkpoints are large; the rest goes with the temp folder
        shutil.rmtree(root / "outputs" / stage, ignore_errors=True)


def api(project: dict, coro_fn):
    """Run `coro_fn(client)` against the project's server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def main():
        async with get_client() as client:
            return await coro_fn(client)

    with temporary_settings({PREFECT_API_URL: f"{project['url']}/api"}):
        return asyncio.run(main())


def flow_runs(project: dict) -> list:
    return api(project, lambda client: client.read_flow_runs())


def test_arpo_run_without_a_server_uses_an_ephemeral_one(project: dict) -> None:
    proc = project["shell"]("arpo run --until data", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "start it with `arpo server start`" in proc.stdout          # it knew no server was up
    assert (project["root"] / "outputs" / "runs" / "latest" / "refs.json").is_file()


@pytest.fixture(scope="module")
def deployed(project: dict) -> dict:
    """The README's deployment commands, line by line, each in a fresh shell. Runs that would train for minutes are
    created against a paused work pool, recorded, and cancelled before the pool resumes."""
    commands = readme_block("Deployments")
    assert commands[0].startswith("arpo deploy"), commands
    outputs = {}
    for command in commands:
        if command.startswith("prefect deployment run") and "--watch" not in command:
            assert project["shell"]("prefect work-pool pause arpo-cpu", timeout=120).returncode == 0
        proc = project["shell"](command, timeout=1200)
        outputs[command] = proc
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    runs = flow_runs(project)
    pending = [run for run in runs if not run.state.is_final()]
    for run in pending:
        assert project["shell"](f"prefect flow-run cancel {run.id}", timeout=120).returncode == 0
    assert project["shell"]("prefect work-pool resume arpo-cpu", timeout=120).returncode == 0
    return {"commands": commands, "outputs": outputs, "runs": runs, "pending": pending}


def test_readme_deployment_commands_work_from_a_fresh_shell(deployed: dict) -> None:
    ran = " ".join(proc.stdout + proc.stderr for proc in deployed["outputs"].values())
    assert "Deployment not found" not in ran
    listed = next(p.stdout for c, p in deployed["outputs"].items() if c.startswith("prefect deployment ls"))
    assert "pipeline-tiny" in listed and "stage-data" in listed, listed
    watched = [c for c in deployed["commands"] if "--watch" in c]
    completed = [run for run in deployed["runs"] if run.state.name == "Completed" and run.deployment_id]
    assert len(completed) == len(watched) >= 1, [(r.name, r.state.name) for r in deployed["runs"]]
    created = [c for c in deployed["commands"] if c.startswith("prefect deployment run") and "--watch" not in c]
    assert len(deployed["pending"]) == len(created)


def test_a_bad_override_fails_once_with_the_config_error(project: dict, deployed: dict) -> None:
    shell = project["shell"]
    before = {run.id for run in flow_runs(project)}
    proc = shell("""prefect deployment run 'arpo-pipeline/stage-data' --param overrides='["data.synthetic.n_mth=3"]' \
                 --watch""", timeout=900)
    new = [run for run in flow_runs(project) if run.id not in before]
    assert len(new) == 1 and new[0].state.name == "Failed", proc.stdout[-2000:]
    assert "unknown config key 'data.synthetic.n_mth': did you mean 'data.synthetic.n_math'?" in new[0].state.message
    assert new[0].run_count == 1
    tasks = api(project, lambda client: client.read_task_runs())
    assert not [t for t in tasks if t.flow_run_id == new[0].id]                  # failed before any stage ran
    # a profile that does not exist is refused by the parameter schema: no run at all
    proc = shell("prefect deployment run 'arpo-pipeline/stage-data' --param profile=tiny-cpuu", timeout=300)
    assert proc.returncode != 0 and "tiny-cpu" in proc.stdout + proc.stderr
    assert len(flow_runs(project)) == len(before) + 1


LOG_PANEL_DELAY_S = 10   # injected into every log request of the task page: the read must wait for its content
PAGE_DEADLINE_S = 600    # a ceiling that only a broken UI reaches; a loaded 2-core box shows the logs in well under


def live_page_text(url: str, expect: tuple[str, ...], screenshot: Path | None = None,
                   delay_logs_s: float = 0.0) -> tuple[str, int]:
    """(the page's rendered text once it shows every `expect`ed string, how many log requests were delayed).

    The Prefect UI fills its panels with later requests (the log panel reads "Waiting for logs..." until its request
    answers), so the read polls the page for the asserted text, reloading it each minute, up to PAGE_DEADLINE_S: a
    slower box waits longer instead of failing. `delay_logs_s` holds every log request that long, to show the wait
    does not depend on the box's speed. The text comes back as it stands at the deadline if it never showed all."""
    require_chromium()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    from tests.integration.tree_browser import FLAGS

    delayed = [0]

    def hold(route) -> None:
        delayed[0] += 1
        time.sleep(delay_logs_s)
        route.continue_()

    shows_all = "expect => document.body && expect.every(e => document.body.innerText.includes(e))"
    deadline = time.monotonic() + PAGE_DEADLINE_S
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=require_chromium(), headless=True, args=FLAGS)
        try:
            tab = browser.new_page(viewport={"width": 1600, "height": 1400})
            if delay_logs_s:
                tab.route("**/api/logs/filter", hold)
            tab.goto(url)
            while True:
                try:
                    tab.wait_for_function(shows_all, arg=list(expect),
                                          timeout=1000 * max(1.0, min(60.0, deadline - time.monotonic())))
                    break
                except PlaywrightTimeout:
                    if time.monotonic() >= deadline:
                        break
                    tab.reload()
            text = " ".join(tab.inner_text("body").split())
            if screenshot is not None:
                tab.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return text, delayed[0]


def _rl_progress(project: dict) -> tuple[object, object, list[str]] | None:
    """(flow run, rl task run, log lines) once RL's first step is logged (its ETA line has reached the server) and
    its progress artifact says 50%."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        LogFilter,
        LogFilterTaskRunId,
    )

    async def read(client):
        tasks = [t for t in await client.read_task_runs() if t.name == "rl" and t.state.name == "Running"]
        if not tasks:
            return None
        rl = tasks[0]
        logs = await client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[rl.id])))
        progress = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["progress-rl"])))
        if not any(a.task_run_id == rl.id and a.data == 50.0 for a in progress):
            return None
        lines = [log.message for log in logs]
        if not any(line.startswith(ETA_LINE) for line in lines):
            return None  # the artifact can reach the server before the batch of log lines that goes with it
        return await client.read_flow_run(rl.flow_run_id), rl, lines

    return api(project, read)


def test_a_running_stage_is_live_in_the_ui_and_a_killed_run_turns_crashed(project: dict, deployed: dict) -> None:
    # `arpo deploy` installed the crash automation with its default of 180 s; the test waits for it, so it asks for
    # 90 s (three missed heartbeats) before the run starts: the automation only follows runs it saw beating
    crash_silent_runs(f"{project['url']}/api", 90)
    command = "exec arpo run " + shlex.join(RL_RUN)
    proc = project["shell"](command, start_new_session=True)
    try:
        deadline, seen = time.monotonic() + 1500, None
        while seen is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(5)
            seen = _rl_progress(project)
        assert seen is not None, (proc.poll(), proc.stdout.read() if proc.poll() is not None else "")
        run, rl, lines = seen
        assert any(line.startswith(ETA_LINE) for line in lines), lines  # the ETA line
        # Freeze the run mid-stage so the pages below show it running, whatever the box's speed. (If the freeze
        # outlasts the 90 s the flow run may already turn Crashed; the task run stays Running.)
        os.killpg(proc.pid, signal.SIGSTOP)
        want = ("Running", ETA_LINE)                        # the task run's state and its ETA log line
        shot = PROJECT_ROOT / "outputs" / "ui" / "task_run_live.png"   # for people: the running RL task's logs
        shot.parent.mkdir(parents=True, exist_ok=True)
        task_page, delayed = live_page_text(f"{project['url']}/runs/task-run/{rl.id}", want, shot,
                                            delay_logs_s=LOG_PANEL_DELAY_S)
        assert all(w in task_page for w in want), task_page[:3000]
        assert delayed >= 1, "the log panel's request was never delayed: its route (/api/logs/filter) moved"
        artifact_page, _ = live_page_text(f"{project['url']}/runs/task-run/{rl.id}?tab=Artifacts", ("progress-rl",))
        assert "progress-rl" in artifact_page, artifact_page[:3000]
        os.killpg(proc.pid, signal.SIGKILL)   # the pipeline dies without a word to the server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = None
    deadline = time.monotonic() + 600           # heartbeats every 30 s; the automation waits 90 s
    while time.monotonic() < deadline and state != "Crashed":
        time.sleep(10)
        state = api(project, lambda client: client.read_flow_run(run.id)).state.name
    assert state == "Crashed"
    crashed = api(project, lambda client: client.read_flow_run(run.id))
    assert "No heartbeat" in crashed.state.message

    rerun = project["shell"]("arpo run " + shlex.join(RL_RUN), timeout=1500)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def latest_logs(client):
        runs = [r for r in await client.read_flow_runs() if r.id != run.id and r.start_time and
                r.start_time > crashed.start_time]
        latest = max(runs, key=lambda r: r.start_time)
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[latest.id])))
        return latest, [log.message for log in logs]

    latest, messages = api(project, latest_logs)
    assert latest.state.name == "Completed"
    assert any(m.startswith("rl: resuming from checkpoint step 1 of 2") for m in messages), messages
