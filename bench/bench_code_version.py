"""What the code part of the stage keys costs: all ten stage entries' code versions (stages/core/codeversion.py)

- cold: a fresh index and no saved one (the first run after a checkout, or after every file changed);
- saved: a fresh index over the saved one (every later `arpo run` process: a stat per module and one JSON read);
- in-process: the same keys again in one process (functools cache);

against the baseline measured in the same run: hashing the raw bytes of every .py file under stages/ (what the
hand-listed package hash read before issue 23, at most).

    .venv/bin/python bench/bench_code_version.py
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from stages.core.codeversion import STAGES, CodeIndex, code_version  # noqa: E402

ENTRIES = ("stages.bootstrap.model", "stages.data.prepare", "stages.sft.stage", "stages.sft.dpo", "stages.rl.stage",
           "stages.rl.merge", "stages.eval.inference", "stages.eval.scoring", "stages.eval.report",
           "stages.heldout.stage")


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_bytes() -> None:
    digest = hashlib.sha256()
    for path in sorted(STAGES.package_dir.rglob("*.py")):
        digest.update(path.read_bytes())


def main(repeats: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "index.json"

        def cold() -> None:
            saved.unlink(missing_ok=True)
            index = CodeIndex(STAGES.package_dir, saved)
            for entry in ENTRIES:
                index.code_version(entry)

        def warm() -> None:
            index = CodeIndex(STAGES.package_dir, saved)
            for entry in ENTRIES:
                index.code_version(entry)

        base = median_s(raw_bytes, repeats)
        cold_s = median_s(cold, repeats)
        warm_s = median_s(warm, repeats)
        [code_version(e) for e in ENTRIES]
        hot_s = median_s(lambda: [code_version(e) for e in ENTRIES], repeats)
    files = len(list(STAGES.package_dir.rglob("*.py")))
    print(f"{files} modules, 10 stage keys, median of {repeats}")
    print(f"baseline raw bytes of every file: {base * 1000:8.1f} ms  (1.00x)")
    for name, value in (("cold (no saved index)", cold_s), ("saved index, new process", warm_s),
                        ("in-process cache", hot_s)):
        print(f"{name:32s}  {value * 1000:8.1f} ms  ({value / base:.2f}x)")
    write_result("code_version", {"cold_ms": round(cold_s * 1000, 1), "saved_ms": round(warm_s * 1000, 1),
                                  "in_process_ms": round(hot_s * 1000, 3), "raw_bytes_ms": round(base * 1000, 1),
                                  "modules": files},
                 summary="cold {cold_ms:.0f} ms, saved index {saved_ms:.0f} ms for the ten stage keys (reading every "
                         "file's bytes: {raw_bytes_ms:.1f} ms)",
                 what="the stage keys' code version: cold, and with the saved per-file index in a new process",
                 command="bench/bench_code_version.py", details="caching.md#the-code-version",
                 conditions={"repeats": repeats, "keys": list(ENTRIES)})


if __name__ == "__main__":
    main()
