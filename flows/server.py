"""The project's local Prefect server: start it (or find it running), and point this process at it.

Used by `arpo run`, `arpo server` and `arpo deploy` (flows/cli.py, flows/extra_commands.py).
"""

from __future__ import annotations

import os
import sys
import tomllib
from urllib.parse import urlparse

from stages.core.env import prefect_settings


def start_prefect_server(port: int | None = None, crash_after: int | None = None):
    """Start the local server (or find it running); a fresh one gets the automation that marks flow runs without
    heartbeats Crashed (flows/automations.py)."""
    from flows.automations import CRASH_AFTER_S, crash_silent_runs
    from stages.core import services

    port = port or default_port()
    url = f"http://127.0.0.1:{port}"
    running = services.load("prefect-server")
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    # The web UI asks the API at PREFECT_SERVER_UI_API_URL, which otherwise defaults to port 4200 (or to a
    # PREFECT_API_URL inherited from the shell): on any other port the page would load and show nothing.
    env = {"PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_UI_API_URL": f"{url}/api", "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}
    service = services.start("prefect-server", cmd, health_url=f"{url}/api/health", url=url, timeout=180, env=env)
    after = CRASH_AFTER_S if crash_after is None else crash_after
    if running is None and after:
        crash_silent_runs(f"{service.url}/api", after)
    return service


def project_api_url() -> str:
    """The API URL in the project's prefect.toml: what `prefect` commands typed in the project folder talk to."""
    return prefect_settings()["api"]["url"]


def default_port() -> int:
    """The port of prefect.toml's api.url (the one place it is set), so `arpo server start` serves where `prefect`
    commands look."""
    port = urlparse(project_api_url()).port
    if port is None:
        raise ValueError(f"prefect.toml's api.url {project_api_url()!r} names no port: write one, e.g. "
                         "http://127.0.0.1:<port>/api")
    return port


def toml_on_port(text: str, port: int) -> str:
    """The text of a prefect.toml with its api.url moved to `port`, the rest as it was: for a copy of the project
    (a test's, a bench's clone) whose server must not meet the one the developer runs on the file's own port."""
    url = tomllib.loads(text)["api"]["url"]
    parts = urlparse(url)
    if parts.port is None or text.count(f'"{url}"') != 1:
        raise ValueError(f"prefect.toml's api.url {url!r} must name a port and be written once, as a quoted string")
    return text.replace(f'"{url}"', f'"{parts._replace(netloc=f"{parts.hostname}:{port}").geturl()}"')


def use_local_server_if_running(ephemeral: bool = False) -> str | None:
    """Point this process at the project's server when one answers (PREFECT_API_URL, the server `arpo server`
    started, or prefect.toml's URL); else at an ephemeral one for this run. Returns the server's URL, or None for
    ephemeral."""
    from stages.core import services

    if not ephemeral and os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"].removesuffix("/api")
    service = None if ephemeral else services.load("prefect-server")
    candidates = [] if ephemeral else [f"{service.url}/api" if service else None, project_api_url()]
    for api in filter(None, candidates):
        if services.healthy(f"{api}/health"):
            os.environ["PREFECT_API_URL"] = api
            return api.removesuffix("/api")
    start_ephemeral_server()
    return None


def start_ephemeral_server() -> str:
    """Prefect's temporary server for this process (stopped at exit), named in PREFECT_API_URL, which also overrides
    prefect.toml. Started here rather than left to Prefect: an empty PREFECT_API_URL (the other way to override
    prefect.toml) sends Prefect 3.7's events to the URL "" — every event then fails with a traceback."""
    import socket

    with socket.socket() as sock:  # the URL goes into the environment before Prefect reads its settings
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    database = _own_database()
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer(port=port)
    # The database variables reach the server's process only (its environment is copied when it starts): left in
    # ours they would send every process this one starts later -- an `arpo server start`, a test's server -- to a
    # folder that is removed at exit ("unable to open database file").
    before = {key: os.environ.get(key) for key in database}
    os.environ.update(database)
    try:
        server.start(timeout=int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")))
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return server.api_url


def _own_database() -> dict[str, str]:
    """The database variables for the temporary server: an SQLite database of its own
    (stages.core.env.ephemeral_database_env), removed at exit after the server stops (atexit runs last-registered
    first; the server registers its stop later)."""
    import atexit
    import shutil

    from stages.core.env import ephemeral_database_dir, ephemeral_database_env, prune_ephemeral_databases

    home = os.environ.get("PREFECT_HOME", ".prefect")
    prune_ephemeral_databases(home)
    database = ephemeral_database_env(home, os.getpid())
    if database:
        folder = ephemeral_database_dir(home, os.getpid())
        folder.mkdir(parents=True, exist_ok=True)
        atexit.register(shutil.rmtree, folder, True)
    return database
