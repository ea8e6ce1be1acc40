"""Project-level Prefect settings: prefect.toml is what a fresh shell in the repo reads, it agrees with the CLI, the
heartbeat settings agree everywhere, `arpo run` falls back to an ephemeral server, and flow parameters are typed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from flows import server as cli
from flows.automations import CRASH_AFTER_S, HEARTBEAT_S, crash_silent_runs
from stages.core.config.loader import profile_names
from stages.core.env import PROJECT_ROOT, local_environment
from stages.core.selection import GROUPS, STAGES

TOML = tomllib.loads((PROJECT_ROOT / "prefect.toml").read_text())


def test_prefect_toml_names_the_server_arpo_starts():
    # the port is stated once, in prefect.toml: the server, the CLI's help and the README's address follow it
    assert TOML["api"]["url"] == f"http://127.0.0.1:{cli.default_port()}/api" == cli.project_api_url()
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert set(re.findall(r"http://127\.0\.0\.1:(\d+)", readme)) == {str(cli.default_port())}
    from flows.cli import build_parser

    assert f"http://127.0.0.1:{cli.default_port()})" in build_parser().format_help()  # `arpo server`'s line


def test_a_copy_of_the_project_moves_its_server_to_a_port_of_its_own():
    # what the UI test's checkout copy and the tiny-chain bench's clone do to their prefect.toml
    text = (PROJECT_ROOT / "prefect.toml").read_text()
    moved = cli.toml_on_port(text, 54321)
    assert tomllib.loads(moved)["api"]["url"] == "http://127.0.0.1:54321/api"
    assert moved.replace(":54321/", f":{cli.default_port()}/") == text  # nothing else changed
    with pytest.raises(ValueError, match="must name a port"):
        cli.toml_on_port('[api]\nurl = "http://127.0.0.1/api"\n', 54321)


def test_a_fresh_shell_in_the_repo_reads_prefect_toml(tmp_path):
    code = "from prefect.settings import get_current_settings as s; print(s().api.url, s().flows.heartbeat_frequency)"
    out = subprocess.run(["env", "-i", f"HOME={tmp_path}", "PATH=/usr/bin:/bin", sys.executable, "-c", code],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == [TOML["api"]["url"], str(HEARTBEAT_S)]


def test_every_route_beats_at_the_same_rate():
    # prefect.toml states the rate; prefect.yaml's work pools carry it in a generated section, env.py passes it on
    from flows.deployments import PREFECT_YAML, job_variables, written_job_variables

    assert written_job_variables(PREFECT_YAML.read_text()) == job_variables(), \
        "prefect.yaml's job variables are stale: run python -m flows.cli docs --write"
    deployments = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    pools = deployments["definitions"]["work_pools"].values()
    assert {pool["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] for pool in pools} == {str(HEARTBEAT_S)}
    assert local_environment()["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(HEARTBEAT_S)
    assert TOML["flows"]["heartbeat_frequency"] == HEARTBEAT_S
    assert CRASH_AFTER_S >= 4 * HEARTBEAT_S
    assert local_environment()["PREFECT_HOME"] == str(PROJECT_ROOT / TOML["home"])
    with pytest.raises(ValueError, match="would crash healthy runs"):
        crash_silent_runs("http://127.0.0.1:1/api", 2 * HEARTBEAT_S)


@pytest.fixture
def no_server(monkeypatch):
    from stages.core import services

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(services, "load", lambda name: None)
    monkeypatch.setattr(services, "healthy", lambda url, timeout=2.0: False)
    return services


def test_without_a_server_arpo_run_goes_ephemeral(no_server, monkeypatch):
    # the run gets its own temporary server, named in PREFECT_API_URL (which beats prefect.toml's URL), instead of
    # an error; never an empty PREFECT_API_URL, which sends Prefect's events to "" (a traceback per event)
    started = []
    monkeypatch.setattr(cli, "start_ephemeral_server", lambda wait=True: started.append(wait))
    assert cli.use_local_server_if_running() is None and started == [True]
    # `arpo run` goes on importing Prefect and the flow while it boots (flows/launch.py waits for it after)
    assert cli.use_local_server_if_running(wait=False) is None and started == [True, False]


def test_the_project_server_is_used_when_it_answers(no_server, monkeypatch):
    monkeypatch.setattr(no_server, "healthy", lambda url, timeout=2.0: url == f"{TOML['api']['url']}/health")
    assert cli.use_local_server_if_running() == TOML["api"]["url"].removesuffix("/api")
    assert os.environ["PREFECT_API_URL"] == TOML["api"]["url"]
    # --ephemeral wins over a server that answers
    started = []
    monkeypatch.setattr(cli, "start_ephemeral_server", lambda wait=True: started.append(1))
    assert cli.use_local_server_if_running(ephemeral=True) is None and started == [1]


def test_flow_parameters_offer_choices():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline

    props = parameter_schema(pipeline).model_dump()["properties"]
    assert props["profile"]["anyOf"][0]["enum"] == profile_names()
    assert props["profile"]["anyOf"][1]["pattern"] == r"\.ya?ml$"          # or a profile file
    assert set(props["until"]["anyOf"][0]["enum"]) == set(STAGES) | set(GROUPS)
    assert set(props["only"]["anyOf"][0]["items"]["enum"]) == set(STAGES) | set(GROUPS)
    assert props["overrides"]["anyOf"][0]["items"]["pattern"].startswith("^")
    with pytest.raises(Exception, match="tiny-cpu"):
        pipeline.validate_parameters({"profile": "tiny-cpuu"})
    with pytest.raises(Exception, match="should match pattern"):
        pipeline.validate_parameters({"overrides": ["rl.rollout.n 8"]})


class FakeLaunch:
    """Stands in for the process manager's launch: records the command and environment the temporary server would
    get, writes the SQLite file a server would migrate (a table), starts nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, cmd, log_path, env=None, supervised=True):
        import sqlite3

        self.calls.append({"cmd": cmd, "env": env, "supervised": supervised})
        db = next(v for k, v in env.items() if k == "PREFECT_SERVER_DATABASE_CONNECTION_URL").split(":///", 1)[1]
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS migrated (n INTEGER)")
        return type("Proc", (), {"pid": -1, "poll": lambda self: None})()


@pytest.fixture
def fake_server(no_server, monkeypatch, tmp_path):
    """A temporary server that starts nothing, in a Prefect home of its own; its exit hooks are collected, not run."""
    from stages.core import procs
    from stages.core.env import DATABASE_URL_KEYS

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    for key in DATABASE_URL_KEYS:
        monkeypatch.delenv(key, raising=False)
    launch, hooks = FakeLaunch(), []
    monkeypatch.setattr(procs, "launch", launch)
    monkeypatch.setattr(procs, "wait_ready", lambda *a, **k: True)
    monkeypatch.setattr(cli.atexit, "register", lambda fn, *args: hooks.append((fn, args)))
    return launch, hooks


def test_an_ephemeral_run_has_a_database_of_its_own(fake_server, tmp_path):
    # `arpo run --ephemeral` beside a running `arpo server`: both SQLite servers on <PREFECT_HOME>/prefect.db ended
    # the run with "database is locked" (issue 31). The run's temporary server gets <PREFECT_HOME>/ephemeral/<pid>/;
    # the result store (what a cached rerun reads) stays where it is.
    import subprocess as sp

    from prefect.settings import Settings

    from stages.core.env import DATABASE_URL_KEYS

    launch, hooks = fake_server
    server = Settings()  # what `arpo server start` (a process without the run's variables) serves from
    assert server.server.database.connection_url.get_secret_value() == f"sqlite+aiosqlite:///{tmp_path}/prefect.db"
    dead = sp.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                  check=True).stdout.strip()
    (tmp_path / "ephemeral" / dead).mkdir(parents=True)  # left by a killed run: pruned

    api = cli.start_ephemeral_server()
    assert os.environ["PREFECT_API_URL"] == api
    run = Settings()
    own = f"sqlite+aiosqlite:///{tmp_path}/ephemeral/{os.getpid()}/prefect.db"
    assert own != f"sqlite+aiosqlite:///{tmp_path}/prefect.db"
    seen = launch.calls[0]["env"]
    assert all(seen[key] == own for key in DATABASE_URL_KEYS)         # the server's process gets its own database
    # ... and ours keeps no database variable: a process it starts later (`arpo server start`, a test's server)
    # would otherwise open a folder that is removed at exit
    assert not any(key in os.environ for key in DATABASE_URL_KEYS)
    assert (tmp_path / "ephemeral" / str(os.getpid())).is_dir() and not (tmp_path / "ephemeral" / dead).exists()
    assert run.results.local_storage_path == server.results.local_storage_path and run.home == server.home
    # Prefect's own command for its temporary server (SubprocessASGIServer's), under the process manager's
    # supervisor (it ends with this process even when this one is killed), without importing Prefect's server here
    cmd = launch.calls[0]["cmd"]
    assert cmd[1:3] == ["-m", "uvicorn"] and cmd[cmd.index("--factory") + 1] == cli.EPHEMERAL_APP
    assert launch.calls[0]["supervised"] and {k: seen[k] for k in cli.EPHEMERAL_ENV} == cli.EPHEMERAL_ENV
    # at exit: the server stops first, then its folder goes (atexit runs the last registered first)
    assert [fn.__name__ for fn, _ in hooks] == ["rmtree", "stop"]


def test_a_temporary_server_starts_from_a_migrated_copy(fake_server, tmp_path):
    # the first temporary server of a Prefect version migrates an empty database (2.5 s of its start); a copy of it
    # is kept, and every later one starts from that copy, so Prefect's migrations find nothing to do
    import sqlite3

    launch, hooks = fake_server
    template = cli.ephemeral_template()
    assert template.parent == tmp_path / "ephemeral" and not template.exists()
    cli.start_ephemeral_server()
    assert template.is_file()
    with sqlite3.connect(template) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("migrated",)]
    folder = tmp_path / "ephemeral" / str(os.getpid())
    (folder / "prefect.db").unlink()
    with sqlite3.connect(template) as conn:  # what the next server finds in its database is the template's
        conn.execute("CREATE TABLE from_template (n INTEGER)")
    cli.start_ephemeral_server(wait=False)  # `arpo run`'s way: its wait comes later
    with sqlite3.connect(folder / "prefect.db") as conn:
        assert ("from_template",) in conn.execute("SELECT name FROM sqlite_master").fetchall()
    cli.ephemeral_server_ready()
    cli.ephemeral_server_ready()  # nothing left to wait for


def test_a_postgres_database_is_kept_for_an_ephemeral_run(tmp_path):
    from stages.core.env import DATABASE_URL_KEYS, ephemeral_database_env

    pg = {"PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://u:p@db/prefect"}
    assert ephemeral_database_env(tmp_path, 7, pg) == {}  # many writers are fine there
    lite = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path}/mine.db"}
    assert set(ephemeral_database_env(tmp_path, 7, lite).values()) == {
        f"sqlite+aiosqlite:///{tmp_path.resolve()}/ephemeral/7/prefect.db"}
    assert set(ephemeral_database_env(tmp_path, 7, {})) == set(DATABASE_URL_KEYS)
