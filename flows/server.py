"""The project's local Prefect server: start it (or find it running), and point this process at it.

Used by `arpo run`, `arpo server` and `arpo deploy` (flows/cli.py, flows/extra_commands.py).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tomllib
from pathlib import Path
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


def use_local_server_if_running(ephemeral: bool = False, wait: bool = True) -> str | None:
    """Point this process at the project's server when one answers (PREFECT_API_URL, the server `arpo server`
    started, or prefect.toml's URL); else at an ephemeral one for this run. Returns the server's URL, or None for
    ephemeral. `wait=False`: return while the ephemeral server still boots (`ephemeral_server_ready` waits)."""
    from stages.core import services

    if not ephemeral and os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"].removesuffix("/api")
    service = None if ephemeral else services.load("prefect-server")
    candidates = [] if ephemeral else [f"{service.url}/api" if service else None, project_api_url()]
    for api in filter(None, candidates):
        if services.healthy(f"{api}/health"):
            os.environ["PREFECT_API_URL"] = api
            return api.removesuffix("/api")
    start_ephemeral_server(wait=wait)
    return None


# The temporary server's command: what Prefect's SubprocessASGIServer runs (prefect 3.7.2,
# prefect/server/api/server.py, `_run_uvicorn_command`: uvicorn on the app factory, no UI), and the variables it adds.
EPHEMERAL_APP = "prefect.server.api.server:create_app"
EPHEMERAL_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
_BOOTING: dict[str, EphemeralServer] = {}  # the temporary server this process started and has not waited for


class EphemeralServer:
    """A temporary server's process (under the process manager's supervisor, so it ends with this process even when
    this one is killed), its URL, log and database."""

    def __init__(self, port: int, database: dict[str, str], folder: Path | None) -> None:
        from stages.core import procs

        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.folder, self.seeded = folder, False
        self.log = (folder or Path(os.environ.get("PREFECT_HOME", ".prefect")) / "ephemeral") / f"server-{port}.log"
        template = ephemeral_template() if folder is not None else None
        if template is not None and template.is_file():  # an already migrated database to start from
            shutil.copyfile(template, folder / "prefect.db")
            self.seeded = True
        cmd = [sys.executable, "-m", "uvicorn", "--app-dir", _site_packages("prefect"), "--factory", EPHEMERAL_APP,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
        # The database variables reach the server's process only: left in ours they would send every process this
        # one starts later -- an `arpo server start`, a test's server -- to a folder that is removed at exit
        # ("unable to open database file").
        self.proc = procs.launch(cmd, self.log, env={**os.environ, **EPHEMERAL_ENV, **database})

    def ready(self, timeout: float) -> str:
        """Wait until it answers /api/health; raise RuntimeError (after stopping it) when it exits or times out."""
        from stages.core import procs

        try:
            procs.wait_ready(self.proc, self.log, timeout, self.answers, f"healthy at {self.url}", on_fail=self.stop)
        except procs.NotReady as err:
            raise RuntimeError(f"the temporary Prefect server {err}") from None
        if self.folder is not None and not self.seeded:
            keep_template(self.folder / "prefect.db")
        return f"{self.url}/api"

    def answers(self) -> bool:
        """Its /api/health answers. Asked only once its port takes a connection (uvicorn binds it after the app's
        start-up): an HTTP client per poll is 15 ms of CPU, taken from the server booting on the other core."""
        import socket

        from stages.core import procs

        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                return False
        return procs.healthy(f"{self.url}/api/health", timeout=1.0)

    def stop(self) -> None:
        """End it at once: its database is removed next and holds nothing a later run reads (cache records and
        results live in the result store); this process has sent its logs and events before its exit hooks got
        here (Prefect registers their flush after this hook, so it runs first)."""
        from stages.core import procs

        procs.kill_group(self.proc.pid, grace_s=0.0, proc=self.proc)


def start_ephemeral_server(wait: bool = True) -> str:
    """Prefect's temporary server for this process (stopped at exit), named in PREFECT_API_URL, which also overrides
    prefect.toml. Started here rather than left to Prefect: an empty PREFECT_API_URL (the other way to override
    prefect.toml) sends Prefect 3.7's events to the URL "" -- every event then fails with a traceback. Started with
    Prefect's own command, without importing Prefect's server module (SubprocessASGIServer lives in the module that
    builds the whole server: 1.5 s of CPU on the 2-core box, only to start a process). `wait=False` returns at once
    (`ephemeral_server_ready` waits): `arpo run` imports Prefect and the flow while the server boots on the other
    core (docs/benchmarks.md, the tiny chain). Returns the API URL."""
    from stages.core import procs

    port = procs.free_port()  # the URL goes into the environment before Prefect reads its settings
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    database, folder = _own_database()
    server = EphemeralServer(port, database, folder)
    atexit.register(server.stop)  # after _own_database's removal of the folder: runs before it
    _BOOTING["server"] = server
    if wait:
        ephemeral_server_ready()
    return os.environ["PREFECT_API_URL"]


def ephemeral_server_ready() -> None:
    """Wait for the temporary server `start_ephemeral_server(wait=False)` started (nothing to do when none boots)."""
    server = _BOOTING.pop("server", None)
    if server is not None:
        server.ready(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")))


def ephemeral_template() -> Path:
    """`<PREFECT_HOME>/ephemeral/template-<prefect version>.db`: the database of the first temporary server of this
    Prefect version, copied once it answered (migrated, block types registered, no run yet). Every later temporary
    server starts from a copy: Prefect's migrations then find nothing to do, where migrating an empty SQLite file
    is 2.5 s of the server's start on the 2-core box (its block registration still runs)."""
    from importlib.metadata import version

    return Path(os.environ.get("PREFECT_HOME", ".prefect")).resolve() / "ephemeral" / f"template-{version('prefect')}.db"


def keep_template(database: Path) -> None:
    """Copy a freshly migrated temporary database to `ephemeral_template()` (SQLite's backup API: a consistent copy
    of a database in use; written beside it and renamed, so a concurrent run never reads half a file)."""
    import sqlite3
    import tempfile

    template = ephemeral_template()
    if template.is_file() or not database.is_file():
        return
    fd, tmp = tempfile.mkstemp(dir=template.parent, prefix=".template-", suffix=".db")
    os.close(fd)
    try:
        source, copy = sqlite3.connect(database), sqlite3.connect(tmp)
        try:
            source.backup(copy)
        finally:
            source.close()
            copy.close()
        os.replace(tmp, template)
    except sqlite3.Error:
        Path(tmp).unlink(missing_ok=True)  # no template: the next temporary server migrates as this one did


def _site_packages(package: str) -> str:
    """The folder holding `package`, found without importing it (uvicorn's --app-dir)."""
    from importlib.util import find_spec

    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not installed in {sys.executable}")
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


def _own_database() -> tuple[dict[str, str], Path | None]:
    """The database variables for the temporary server: an SQLite database of its own
    (stages.core.env.ephemeral_database_env), removed at exit after the server stops (atexit runs last-registered
    first; the server registers its stop later), and its folder (None: a database the user configured, kept)."""
    from stages.core.env import ephemeral_database_dir, ephemeral_database_env, prune_ephemeral_databases

    home = os.environ.get("PREFECT_HOME", ".prefect")
    prune_ephemeral_databases(home)
    database = ephemeral_database_env(home, os.getpid())
    if not database:
        return database, None
    folder = ephemeral_database_dir(home, os.getpid())
    folder.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, folder, True)
    return database, folder
