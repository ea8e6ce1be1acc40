"""Tool latency, each figure as a ratio against a baseline measured in the same run.

    .venv/bin/python bench/bench_tools.py [--repeats 10] [--queries 300]

1. python tool, two snippets (trivial; numpy + sympy). Baseline: a naive `python -c <code>` subprocess (what
   the reference does, no isolation). Measured: the sandbox (bubblewrap when it works here, else the rlimit
   fallback, and the fallback explicitly) cold (pool_size 0: a fresh interpreter per call, imports included)
   and warm (pool_size 2, each call taken from a pool that had time to pre-start; the wait is not timed),
   plus a ToolBox call answered from the SQLite tool cache.
2. BM25 over the passages of ../shared/data/search_cache.json (every `Page i:` line is a document), queried
   with the file's own keys. Baseline: a plain-Python BM25 (same tokenisation, dict postings, full sort).
   Measured: `BM25Backend.search` one query at a time and `batch_search` per query; index build time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

SNIPPETS = {
    "trivial": "x = 21\nx * 2",
    "numpy+sympy": "import numpy as np, sympy as sp\nm = np.arange(9.0).reshape(3, 3) + np.eye(3)\n"
                   "print(round(float(np.linalg.det(m)), 3), sp.factorint(2**20 - 1))",
}
SEARCH_CACHE = PROJECT_ROOT.parent / "shared" / "data" / "search_cache.json"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def row(name: str, values: list[float], base: float | None) -> str:
    p50, p95 = pct(values, 0.5), pct(values, 0.95)
    ratio = f"{p50 / base:9.4f}x" if base else "   (base) "
    return f"  {name:<34} p50 {p50 * 1000:10.3f} ms   p95 {p95 * 1000:10.3f} ms   p50 vs baseline {ratio}"


def naive_python(code: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              check=False)
        times.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr
    return times


def sandbox_times(cfg, code: str, repeats: int, warm: bool) -> tuple[list[float], str]:
    from stages.agent.sandbox import PythonSandbox

    times = []
    with PythonSandbox(cfg) as box:
        for _ in range(repeats):
            if warm:
                box.wait_warm(120)
            start = time.perf_counter()
            result = box.run(code)
            times.append(time.perf_counter() - start)
            assert result.ok, result.text
        return times, box.mode


def cached_toolbox_times(agent_cfg, code: str, repeats: int) -> list[float]:
    from stages.agent.protocol import ToolCall
    from stages.agent.toolbox import ToolBox

    with tempfile.TemporaryDirectory(prefix="bench-tools-") as cache_root, \
            ToolBox.from_config(agent_cfg, None, cache_root, tools=("python",)) as box:
        assert box.execute(ToolCall("python", code), box.new_state()).ok  # fills the cache
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            assert box.execute(ToolCall("python", code), box.new_state()).cached
            times.append(time.perf_counter() - start)
        return times


def bench_python(repeats: int) -> None:
    from stages.core.config.agent import AgentSection, PythonToolSection

    print(f"python tool ({repeats} calls each; baseline = naive `python -c` subprocess)")
    for label, code in SNIPPETS.items():
        print(f" snippet {label!r}")
        base_times = naive_python(code, repeats)
        base = pct(base_times, 0.5)
        print(row("naive python -c", base_times, None))
        for mode in ("auto", "rlimit"):
            cold_cfg = PythonToolSection(sandbox=mode, pool_size=0)
            cold, used = sandbox_times(cold_cfg, code, repeats, warm=False)
            print(row(f"sandbox {used} cold", cold, base))
            warm, used = sandbox_times(cold_cfg.model_copy(update={"pool_size": 2}), code, repeats, warm=True)
            print(row(f"sandbox {used} warm pool", warm, base))
        cached = cached_toolbox_times(AgentSection(python=PythonToolSection(pool_size=1)), code, repeats)
        print(row("ToolBox cache hit", cached, base))


def naive_bm25(docs: list[list[str]]):
    """Plain-Python BM25 (k1 1.5, b 0.75, Lucene idf) with dict postings: the baseline."""
    k1, b = 1.5, 0.75
    avg = sum(map(len, docs)) / len(docs)
    postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, doc in enumerate(docs):
        for term, tf in Counter(doc).items():
            postings[term].append((i, tf))
    idf = {t: math.log(1 + (len(docs) - len(p) + 0.5) / (len(p) + 0.5)) for t, p in postings.items()}

    def search(tokens: list[str], k: int) -> list[int]:
        scores: dict[int, float] = defaultdict(float)
        for term in tokens:
            for i, tf in postings.get(term, ()):
                scores[i] += idf[term] * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(docs[i]) / avg))
        return [i for i, _ in sorted(scores.items(), key=lambda kv: -kv[1])[:k]]

    return search


def bench_bm25(n_queries: int) -> None:
    import bm25s
    import Stemmer

    from stages.agent.search.base import normalize_query, parse_formatted
    from stages.agent.search.local import BM25Backend

    cache = json.loads(SEARCH_CACHE.read_text())
    docs = [{"id": f"d{i}", "contents": p.contents} for i, p in
            enumerate(p for value in cache.values() for p in parse_formatted(value))]
    queries = [normalize_query(q) for q in list(cache)[:n_queries]]
    print(f"\nBM25 over {len(docs)} passages of search_cache.json, {len(queries)} queries, top 10")
    stemmer = Stemmer.Stemmer("english")
    tokens = bm25s.tokenize([d["contents"] for d in docs], stopwords="en", stemmer=stemmer, return_ids=False,
                            show_progress=False)
    naive = naive_bm25(tokens)
    q_tokens = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False)
    base_times = []
    for q in q_tokens:
        start = time.perf_counter()
        naive(q, 10)
        base_times.append(time.perf_counter() - start)
    base = pct(base_times, 0.5)
    print(row("plain-Python BM25", base_times, None))
    with tempfile.TemporaryDirectory(prefix="bench-bm25-") as folder:
        corpus = Path(folder) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
        start = time.perf_counter()
        backend = BM25Backend(corpus, folder)
        print(f"  index build + load: {time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        BM25Backend(corpus, folder)
        print(f"  cached index load:  {time.perf_counter() - start:.2f} s")
        single = []
        for q in queries:
            start = time.perf_counter()
            backend.search(q, 10)
            single.append(time.perf_counter() - start)
        print(row("BM25Backend.search", single, base))
        start = time.perf_counter()
        backend.batch_search(queries, 10)
        per_query = (time.perf_counter() - start) / len(queries)
        print(f"  {'BM25Backend.batch_search':<34} mean {per_query * 1000:8.2f} ms/query"
              f"   vs baseline p50 {per_query / base:8.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--skip-python", action="store_true")
    args = parser.parse_args()
    if not args.skip_python:
        bench_python(args.repeats)
    bench_bm25(args.queries)
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared machine: "
          "absolute times vary, ratios less)")


if __name__ == "__main__":
    main()
