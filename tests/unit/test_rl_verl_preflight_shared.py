"""What the verl engine's workers share: one web-search rate limit for all worker processes of a run, a tool cache
that is per host (and without WAL) on a network filesystem, and the trees verl dropped, counted by cause and
stopped on by the `trees_dropped` alarm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from stages.agent.cache import ToolCache, host_path
from stages.agent.sandbox.host import SandboxUnavailable
from stages.agent.search import SearchError
from stages.core import reporter
from stages.core.config.rl import AlarmSection
from stages.core.env import PROJECT_ROOT
from stages.core.ratelimit import SharedRateLimiter
from stages.core.store import filesystem_type, network_filesystem
from stages.rl.alarms import AlarmStop, AlarmWatch, detect_alarms
from stages.rl.verl.advantage import tree_metrics
from stages.rl.verl.failures import INFRA, OTHER, TreeFailureLog, record_failure, tree_fault

RATE = 200.0   # requests per second: one slot every 5 ms
WORKER = textwrap.dedent("""
    import json, sys
    from stages.agent.search import build_search
    from stages.core.config.agent import SearchSection
    cfg = SearchSection(backend="web", web={"requests_per_second": %r, "api_key_env": "ARPO_TEST_SHARED_KEY"})
    backend = build_search(cfg, None, sys.argv[1])          # what each agent-loop worker process builds
    print(json.dumps([backend._limiter.reserve() for _ in range(6)]))
""") % RATE


def test_two_worker_processes_share_one_provider_limit(tmp_path):
    """Two processes reserve 6 slots each against one limit of RATE/s: the 12 slots are all at least one interval
    apart (per-process limiters would hand both processes the same early slots)."""
    env = {**os.environ, "ARPO_TEST_SHARED_KEY": "k", "PYTHONPATH": str(PROJECT_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "cache")], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    slots = sorted(s for proc in procs for s in json.loads(proc.communicate(timeout=60)[0]))
    assert all(proc.returncode == 0 for proc in procs) and len(slots) == 12
    gaps = [b - a for a, b in zip(slots, slots[1:])]
    assert min(gaps) >= 1 / RATE - 1e-6, gaps          # 1e-6: float spacing of time.time() values (~2e-7)
    assert list((tmp_path / "cache" / "rate-limits").iterdir())[0].name == "web-brightdata-serp_api1.slot"
    # the in-process spacing still holds for threads of one process, and a stale far-future slot is ignored
    limiter = SharedRateLimiter(tmp_path / "one.slot", RATE)
    (tmp_path / "one.slot").write_text(repr(1e12))
    first, second = limiter.reserve(), limiter.reserve()
    assert first < 1e11 and second - first == pytest.approx(1 / RATE, abs=1e-6)


MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
server:/export {shared} nfs4 rw,vers=4.2 0 0
/dev/sdb1 {shared}/local\\040disk ext4 rw 0 0
"""


def test_network_filesystems_are_found_in_the_mount_table(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS.format(shared=tmp_path / "shared"))
    assert filesystem_type(tmp_path / "shared" / "x" / "cache.sqlite", mounts) == "nfs4"
    assert network_filesystem(tmp_path / "shared" / "local disk" / "c.sqlite", mounts) is None   # longest mount
    assert network_filesystem(tmp_path / "elsewhere", mounts) is None and filesystem_type("/", mounts) == "ext4"
    assert filesystem_type("/x", tmp_path / "no-such-file") is None                             # not Linux


def test_the_tool_cache_is_per_host_without_wal_on_a_network_filesystem(tmp_path):
    import socket

    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS.format(shared=tmp_path / "shared"))
    shared = tmp_path / "shared" / "tool_cache.sqlite"
    assert host_path(shared, mounts).name == f"tool_cache.{socket.gethostname()}.sqlite"
    with ToolCache(shared, mounts=mounts) as cache:
        assert cache.path == host_path(shared, mounts) and cache.shared_fs == "nfs4"
        assert cache._conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        cache.put("search", "v1", "q", "b", {"text": "t"})
        assert cache.get("search", "v1", "q", "b") == {"text": "t"}
    with ToolCache(tmp_path / "local" / "tool_cache.sqlite", mounts=mounts) as cache:   # a local disk: unchanged
        assert cache.path.name == "tool_cache.sqlite" and cache.journal_mode == "WAL"
        assert cache._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_tree_failures_are_classified_and_counted_per_step(tmp_path):
    try:
        raise SearchError("provider down") from ConnectionError("refused")
    except SearchError as err:
        wrapped = err
    assert tree_fault(SandboxUnavailable("bwrap")) == INFRA and tree_fault(TimeoutError()) == INFRA
    assert tree_fault(RuntimeError("verl aborted a generate request")) == INFRA and tree_fault(wrapped) == INFRA
    assert tree_fault(RuntimeError("the tree has 3 trajectories")) == OTHER
    assert tree_fault(ValueError("bad tool call")) == OTHER and tree_fault(KeyError("x")) == OTHER
    path = str(tmp_path / "tree_failures.jsonl")
    log = TreeFailureLog(path)
    assert log.take() == {}                                         # no file yet: nothing dropped
    record_failure(path, "u1", False, SandboxUnavailable("no bwrap"))
    record_failure(path, "u2", False, ValueError("our bug"))
    record_failure(path, "u3", True, SandboxUnavailable("no bwrap"))  # a validation tree: not a training drop
    with open(path, "a") as handle:
        handle.write('{"uid": "u4", "validate": false, "fault": "infra"')   # a line still being written
    assert log.take() == {INFRA: 1, OTHER: 1}
    with open(path, "a") as handle:
        handle.write("}\n")
    assert log.take() == {INFRA: 1}                                 # the next step reads only the new line
    # a step of 8 prompts with 5 whole trees and 2 infra failures logged: 3 dropped = 2 infra + 1 other
    assert tree_metrics(5, 8, infra=2) == {"rollout/trees_trained": 5.0, "rollout/trees_dropped": 3.0,
                                           "rollout/trees_dropped_infra": 2.0, "rollout/trees_dropped_other": 1.0}
    assert tree_metrics(8, 8, infra=1)["rollout/trees_dropped_infra"] == 0.0   # never more than were dropped


def test_the_trees_dropped_alarm_warns_and_stops_when_asked(tmp_path):
    def row(trained, dropped, infra):
        return {"step": 1, **tree_metrics(trained, trained + dropped, infra)}

    # default share 0.1: 1 of 16 trees (6 %) is quiet; 2 of 16 (12.5 %) fires, and the message splits the causes
    assert detect_alarms([row(15, 1, 1)]) == []
    (alarm,) = detect_alarms([row(14, 2, 1)])
    assert alarm.name == "trees_dropped" and "2 of 16 trees (12%)" in alarm.message
    assert "1 on the infrastructure" in alarm.message and "1 other" in alarm.message
    assert detect_alarms([{"step": 1, "reward/mean": 0.0}]) == []   # the local engine drops no trees
    previous = reporter.set_reporter(reporter.Reporter())
    try:
        with pytest.raises(AlarmStop, match="trees_dropped.*rl.alarms.stop_on"):
            AlarmWatch(AlarmSection(stop_on=("trees_dropped",)), tmp_path / "a.jsonl").check([row(8, 8, 8)])
    finally:
        reporter.set_reporter(previous)
