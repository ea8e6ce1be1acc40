"""Tool latency, each figure as a ratio against a baseline measured in the same run.

    .venv/bin/python bench/bench_tools.py [--repeats 10] [--callers 8] [--concurrent-calls 32] [--queries 300]

1. python tool, two snippets (trivial; numpy + sympy). Baseline: a naive `python -c <code>` subprocess (what
   the reference does, no isolation), one caller at a time (p50) and `--callers` threads calling back to back
   (mean latency). Measured the same two ways: the sandbox (bubblewrap, and the rlimit mode), whose warm parent
   forks every call into fresh namespaces; plus a ToolBox call answered from the SQLite tool cache. The
   headline ratio is the sandbox's mean latency under `--callers` concurrent callers against the naive
   subprocess's under the same load (and, stricter, against the naive subprocess with the machine to itself).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

SNIPPETS = {
    "trivial": "x = 21\nx * 2",
    "numpy+sympy": "import numpy as np, sympy as sp\nm = np.arange(9.0).reshape(3, 3) + np.eye(3)\n"
                   "print(round(float(np.linalg.det(m)), 3), sp.factorint(2**20 - 1))",
}
SEARCH_CACHE = PROJECT_ROOT.parent / "shared" / "data" / "search_cache.json"
FIGURES: dict[str, float] = {}  # what the run measured, for bench/results/tools.json


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def row(name: str, values: list[float], base: float | None) -> str:
    p50, p95 = pct(values, 0.5), pct(values, 0.95)
    ratio = f"{p50 / base:9.4f}x" if base else "   (base) "
    return f"  {name:<40} p50 {p50 * 1000:10.3f} ms   p95 {p95 * 1000:10.3f} ms   p50 vs baseline {ratio}"


def mean_row(name: str, values: list[float], base_same_load: float | None, base_alone: float | None) -> str:
    mean = sum(values) / len(values)
    ratios = "   (base)" if base_same_load is None else (
        f"vs naive under the same load {mean / base_same_load:7.4f}x   vs naive alone {mean / base_alone:7.4f}x")
    return f"  {name:<40} mean {mean * 1000:9.1f} ms   {ratios}"


def timed(call, code: str) -> float:
    start = time.perf_counter()
    call(code)
    return time.perf_counter() - start


def concurrently(call, code: str, callers: int, calls: int) -> list[float]:
    """Latency of each of `calls` calls made by `callers` threads back to back."""
    with ThreadPoolExecutor(max_workers=callers) as pool:
        return list(pool.map(lambda _: timed(call, code), range(calls)))


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and every process below it, reaped children included (the sandbox's warm parent
    and the calls it forked)."""
    import psutil

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # ended meanwhile: its time is in its parent's children_* now
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def cpu_per_call(box, run, code: str, calls: int) -> float:
    """CPU seconds per call: the sandbox's processes plus this (host) process."""
    root = box._parent._zygote.proc.pid
    sandbox0, host0 = tree_cpu_s(root), time.process_time()
    for _ in range(calls):
        run(code)
    return (tree_cpu_s(root) - sandbox0 + time.process_time() - host0) / calls


def naive_call(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr


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


def bench_python(repeats: int, callers: int, calls: int) -> None:
    from stages.agent.sandbox.executor import PythonSandbox
    from stages.core.config.agent import AgentSection, PythonToolSection

    print(f"python tool ({repeats} calls alone, {calls} calls by {callers} concurrent callers; "
          "baseline = naive `python -c` subprocess)")
    boxes = {mode: PythonSandbox(PythonToolSection(sandbox=mode)) for mode in ("bwrap", "rlimit")}
    try:
        for box in boxes.values():
            assert box.wait_warm(120)
        for label, code in SNIPPETS.items():
            print(f" snippet {label!r}")
            alone = [timed(naive_call, code) for _ in range(repeats)]
            base_alone = pct(alone, 0.5)
            print(row("naive python -c, 1 caller", alone, None))
            loaded = concurrently(naive_call, code, callers, max(callers, calls // 2))
            base_loaded = sum(loaded) / len(loaded)
            print(mean_row(f"naive python -c, {callers} callers", loaded, None, None))
            for mode, box in boxes.items():
                def run(snippet: str, box=box) -> None:
                    result = box.run(snippet)
                    assert result.ok, result.text
                box.run(code)  # first call of a snippet pays its lazy imports in the warm parent's copy
                one = [timed(run, code) for _ in range(repeats)]
                print(row(f"sandbox {mode}, 1 caller", one, base_alone))
                loaded_box = concurrently(run, code, callers, calls)
                print(mean_row(f"sandbox {mode}, {callers} callers", loaded_box, base_loaded, base_alone))
                cpu = cpu_per_call(box, run, code, repeats)
                key, mean = f"{label.replace('+', '_')}_{mode}", sum(loaded_box) / len(loaded_box)
                FIGURES.update({f"{key}_alone_x": round(pct(one, 0.5) / base_alone, 4),
                                f"{key}_loaded_x": round(mean / base_loaded, 4),
                                f"{key}_loaded_vs_alone_x": round(mean / base_alone, 4),
                                f"{key}_cpu_ms": round(cpu * 1000, 1)})
                print(f"  {'':<40} CPU per call {cpu * 1000:.1f} ms (sandbox processes + host): on an idle machine "
                      f"{callers} callers on {os.cpu_count()} cores would wait about "
                      f"{callers * cpu / os.cpu_count() * 1000:.0f} ms")
            agent = AgentSection(python=PythonToolSection(seed=0), cache={"tools": ["search", "python"]})
            print(row("ToolBox cache hit (seeded python)", cached_toolbox_times(agent, code, repeats), base_alone))
    finally:
        for box in boxes.values():
            box.close()


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
        FIGURES["bm25_search_x"] = round(pct(single, 0.5) / base, 4)
        start = time.perf_counter()
        backend.batch_search(queries, 10)
        per_query = (time.perf_counter() - start) / len(queries)
        print(f"  {'BM25Backend.batch_search':<34} mean {per_query * 1000:8.2f} ms/query"
              f"   vs baseline p50 {per_query / base:8.3f}x")
        FIGURES["bm25_batch_x"] = round(per_query / base, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--callers", type=int, default=8, help="concurrent callers of the python tool")
    parser.add_argument("--concurrent-calls", type=int, default=32, help="calls they make in all")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--skip-python", action="store_true")
    parser.add_argument("--skip-bm25", action="store_true")
    args = parser.parse_args()
    if not args.skip_python:
        bench_python(args.repeats, args.callers, args.concurrent_calls)
    if not args.skip_bm25:
        bench_bm25(args.queries)
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared machine: "
          "absolute times vary, ratios less)")
    parts = []
    if "numpy_sympy_bwrap_alone_x" in FIGURES:
        parts.append("numpy+sympy snippet, bwrap sandbox: 1 caller {numpy_sympy_bwrap_alone_x:.3f}x the naive; "
                     f"{args.callers} concurrent callers "
                     "{numpy_sympy_bwrap_loaded_x:.3f}x the naive under the same load "
                     "({numpy_sympy_bwrap_loaded_vs_alone_x:.2f}x the naive alone; {numpy_sympy_bwrap_cpu_ms:.0f} ms "
                     "CPU per call)")
    if "bm25_search_x" in FIGURES:
        parts.append("BM25 search {bm25_search_x:.2f}x")
    if parts:  # both halves skipped: nothing measured, the last result stays
        write_result("tools", FIGURES, summary="; ".join(parts),
                     what="python sandbox (warm parent, fresh namespaces per call) vs a naive `python -c`, 1 and "
                          f"{args.callers} concurrent callers; bm25s vs plain-Python BM25",
                     command="bench/bench_tools.py", details="agent.md#benchmarks", conditions=vars(args))


if __name__ == "__main__":
    main()
