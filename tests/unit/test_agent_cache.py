"""Tool-result cache: keys, counters, persistence, and two processes writing at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from stages.agent.cache import ToolCache, cache_key
from stages.core.env import PROJECT_ROOT

WRITER = textwrap.dedent("""
    import sys
    from stages.agent.cache import ToolCache
    path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cache = ToolCache(path)
    for i in range(n):
        cache.put("search", "v1", f"{name}-{i}", "local:c1", {"text": f"{name} result {i}"})
        cache.put("search", "v1", f"shared-{i % 20}", "local:c1", {"text": f"shared {i % 20}"})
        assert cache.get("search", "v1", f"{name}-{i}", "local:c1") == {"text": f"{name} result {i}"}
    cache.close()
    print("done", name)
""")


def test_key_separates_every_part():
    base = cache_key("search", "v1", "q", "local:c1")
    assert base == cache_key("search", "v1", "q", "local:c1")
    others = {cache_key("python", "v1", "q", "local:c1"), cache_key("search", "v2", "q", "local:c1"),
              cache_key("search", "v1", "q2", "local:c1"), cache_key("search", "v1", "q", "local:c2")}
    assert base not in others and len(others) == 4


def test_get_put_counters_and_persistence(tmp_path):
    path = tmp_path / "tools.sqlite"
    with ToolCache(path) as cache:
        assert cache.get("python", "v", "print(1)", "sandbox") is None
        cache.put("python", "v", "print(1)", "sandbox", {"text": "1", "meta": {"status": "ok"}})
        assert cache.get("python", "v", "print(1)", "sandbox") == {"text": "1", "meta": {"status": "ok"}}
        # one miss then one hit: rate 1/2
        assert cache.stats() == {"cache_hits": 1.0, "cache_misses": 1.0, "cache_writes": 1.0, "cache_hit_rate": 0.5}
    with ToolCache(path) as again:  # a new process or run sees the row; its own counters start at zero
        assert again.get("python", "v", "print(1)", "sandbox")["text"] == "1"
        assert len(again) == 1 and again.stats()["cache_hits"] == 1.0


def test_two_processes_write_concurrently(tmp_path):
    path = tmp_path / "shared.sqlite"
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(n)], cwd=PROJECT_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err  # no "database is locked", no lost write
    with ToolCache(path) as cache:
        # 150 private keys per writer + 20 shared keys written by both
        assert len(cache) == 2 * n + 20
        assert cache.get("search", "v1", "b-149", "local:c1") == {"text": "b result 149"}
        assert cache.get("search", "v1", "shared-7", "local:c1") == {"text": "shared 7"}
