"""The verl pre-flight builds what the agent-loop workers will build (stages/rl/verl/node_check.py) and stops with
the fix before Ray starts: a sandbox that cannot start, a node without bubblewrap, a missing search key, a tool
cache that cannot be written; the per-node Ray fan-out's report; and no CUDA context in the launcher."""

from __future__ import annotations

import json
import sys

import pytest

from stages.agent.sandbox.executor import probe_bwrap
from stages.core.config.agent import AgentSection
from stages.core.config.rl_engine import VerlSection
from stages.rl.verl.node_check import WorkerSetupError, check_cluster, check_node, require_workers
from stages.rl.verl.settings import PluginSettings, write_settings

NO_KEY = "ARPO_TEST_PREFLIGHT_NO_KEY"
NODE_A, NODE_B, NODE_C = ("a" * 56, "b" * 56, "c" * 56)   # Ray node ids: 28 bytes in hex


def _settings(tmp_path, **agent) -> str:
    """Plugin settings as the launcher writes them: a replay search backend (no network), no preloads (fast)."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"capital of france": "Page 1: Paris"}))
    base = {"python": {"preload": []}, "search": {"backend": "replay", "replay_path": str(replay)}}
    for key, value in agent.items():
        base[key] = value if key == "search" else {**base.get(key, {}), **value}
    settings = PluginSettings(algorithm="arpo", agent=AgentSection.model_validate(base),
                              cache_root=str(tmp_path / "cache"))
    return str(write_settings(settings, tmp_path / "plugin_settings.json"))


@pytest.fixture
def fresh_bwrap_probe():
    probe_bwrap.cache_clear()   # the probe's answer is cached per process
    yield
    probe_bwrap.cache_clear()


def test_a_working_host_passes_with_one_real_sandbox_call(tmp_path):
    report = check_node(_settings(tmp_path))
    assert report["ok"], report["problems"]
    assert report["checks"]["tools"]["python"]["output"].strip() == "42"      # print(6 * 7) ran in the sandbox
    assert report["checks"]["tools"]["search"]["backend"] == "replay"
    cache = report["checks"]["tool_cache"]
    assert cache["journal_mode"] == "WAL" and cache["path"].endswith("tool_cache.sqlite")   # tmp is not NFS
    assert require_workers([report]) == [report]


@pytest.mark.parametrize("python", ["/bin/false", "/nonexistent/bin/python3"])
def test_a_sandbox_that_cannot_start_stops_the_run_with_the_fix(tmp_path, python):
    report = check_node(_settings(tmp_path, python={"sandbox": "rlimit", "python_executable": python}))
    assert not report["ok"]
    (problem,) = report["problems"]
    assert "python tool cannot be built" in problem and python in problem
    assert "set agent.python.python_executable to a working python" in problem
    with pytest.raises(WorkerSetupError, match=r"(?s)1 of 1 host\(s\).*agent\.python\.python_executable"):
        require_workers([report])


def test_a_node_without_bubblewrap_is_refused_with_the_install_fix(tmp_path, monkeypatch, fresh_bwrap_probe):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))           # this "node" has no bwrap on its PATH
    report = check_node(_settings(tmp_path, python={"sandbox": "bwrap"}))
    (problem,) = report["problems"]
    assert "bubblewrap is not installed" in problem and "apt-get install -y bubblewrap" in problem
    assert "agent.python.sandbox: rlimit" in problem           # the explicit weaker alternative is named too


def test_a_missing_search_key_names_the_variable_and_every_node(tmp_path, monkeypatch):
    monkeypatch.delenv(NO_KEY, raising=False)
    report = check_node(_settings(tmp_path, search={"backend": "web", "web": {"api_key_env": NO_KEY}}))
    (problem,) = report["problems"]
    assert f"export {NO_KEY}=" in problem and "secret_block" in problem
    assert f"export {NO_KEY} before `ray start` on every node" in problem
    monkeypatch.setenv(NO_KEY, "a-key")               # with the key the web backend builds (no request is sent)
    assert check_node(_settings(tmp_path, search={"backend": "web", "web": {"api_key_env": NO_KEY}}))["ok"]


def test_missing_settings_and_an_unwritable_cache_are_reported(tmp_path):
    missing = check_node(str(tmp_path / "nowhere.json"))
    assert "shared filesystem" in missing["problems"][0]
    blocker = tmp_path / "file"
    blocker.write_text("")                             # a file where the cache's folder should be
    report = check_node(_settings(tmp_path, cache={"path": str(blocker / "sub" / "tool_cache.sqlite")}))
    (problem,) = report["problems"]
    assert "is not writable here" in problem and "agent.cache.path" in problem


class _FakeRay:
    """Enough of `ray` for check_cluster: two alive nodes (one whose worker cannot import the project) and a dead
    one; tasks run in this process at submission."""

    def __init__(self) -> None:
        self.calls: list = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs["address"]))

    def shutdown(self):
        self.calls.append(("shutdown",))

    def nodes(self):
        return [{"NodeID": NODE_A, "NodeManagerAddress": "10.0.0.1", "NodeManagerHostname": "gpu-a", "Alive": True,
                 "Resources": {"CPU": 64.0}},
                {"NodeID": NODE_B, "NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"CPU": 32.0}},
                {"NodeID": NODE_C, "NodeManagerAddress": "10.0.0.3", "Alive": False, "Resources": {"CPU": 8.0}}]

    def remote(self, **options):
        assert options == {"num_cpus": 0, "max_retries": 0}   # runs even when verl-sized reservations fill a node
        fake = self

        class Task:
            def __init__(self, fn):
                self.fn, self.node = fn, None

            def options(self, scheduling_strategy):
                assert scheduling_strategy.soft is False
                fake.calls.append(("pinned", scheduling_strategy.node_id))
                self.node = scheduling_strategy.node_id
                return self

            def remote(self, *args):
                if self.node == NODE_B:
                    return ("error", ModuleNotFoundError("No module named 'stages'"))
                return ("value", self.fn(*args))
        return Task

    def wait(self, refs, num_returns, timeout):
        return refs, []

    def get(self, ref):
        kind, value = ref
        if kind == "error":
            raise value
        return value


def test_the_per_node_fan_out_pins_one_check_to_every_alive_node(tmp_path):
    fake = _FakeRay()
    out = check_cluster("ray://head:10001", _settings(tmp_path), ray_module=fake)
    assert out["node_cpus"] == [64.0, 32.0]
    assert ("pinned", NODE_A) in fake.calls and ("pinned", NODE_B) in fake.calls
    assert ("pinned", NODE_C) not in fake.calls                                     # a dead node is not asked
    assert fake.calls[0] == ("init", "ray://head:10001") and fake.calls[-1] == ("shutdown",)
    good, bad = out["workers"]
    assert good["ok"] and good["checks"]["tools"]["python"]["output"].strip() == "42"
    assert bad["host"] == "10.0.0.2" and "install this project into verl's environment on every node" in \
        bad["problems"][0]
    with pytest.raises(WorkerSetupError, match=r"(?s)1 of 2 host\(s\).*10\.0\.0\.2"):
        require_workers(out["workers"])


def test_the_launchers_preflight_stops_before_ray_without_a_cuda_context(tmp_path, monkeypatch):
    """`preflight` (what run_rl_verl calls before verl) refuses a missing key in seconds; GPU memory is read in a
    subprocess, so the launcher never initialises CUDA (here: torch.cuda's calls fail if used in-process)."""
    import torch

    from stages.rl.verl import resources

    def in_process(*args, **kwargs):
        raise AssertionError("the launcher must not touch torch.cuda")

    monkeypatch.setattr(torch.cuda, "mem_get_info", in_process)
    monkeypatch.setattr(torch.cuda, "is_available", in_process)
    monkeypatch.delenv(NO_KEY, raising=False)
    settings = _settings(tmp_path, search={"backend": "web", "web": {"api_key_env": NO_KEY}})
    vs = VerlSection(n_gpus_per_node=1, storage_units=1, agent_workers=1, reward_workers=1, ray_num_cpus=8,
                     gpu_memory_utilization=0.01, extra_overrides=["trainer.device=cpu"])   # a CPU run measures RAM
    with pytest.raises(WorkerSetupError, match=f"export {NO_KEY}"):
        resources.preflight(vs, settings)
    assert not torch.cuda.is_initialized()
    # the probe's answer on a GPU box, from a fake probe process: (kind, total, free)
    fake = [sys.executable, "-c", "print('{\"kind\": \"cuda\", \"free\": 5, \"total\": 80}')"]
    assert resources.device_memory(fake) == ("cuda", 80, 5)
    with pytest.raises(resources.VerlResourceError, match="device-memory probe failed"):
        resources.device_memory([sys.executable, "-c", "import sys; sys.exit(3)"])
    report = resources.preflight(vs.model_copy(update={"ray_num_cpus": 8}), None)
    assert report["ray"]["need"]["total"] == 8 and "workers" not in report
