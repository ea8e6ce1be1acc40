"""What checking cached outputs costs: every complete stage folder under an outputs root, checked against its
manifest the way a cache hit does (`quick`: sizes, small or touched files hashed) and the way `arpo run --verify`
does (`full`: every byte hashed). The full check is the baseline measured in the same run.

    .venv/bin/python bench/bench_cache_check.py outputs/      # after a run of the chain into outputs/
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from stages.core.manifest import load  # noqa: E402
from stages.core.workspace import MARKER, verify  # noqa: E402


def timed(folders: list[Path], full: bool, repeats: int) -> float:
    """Median seconds to check every folder once."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for folder in folders:
            problems = verify(folder, full=full)
            assert not problems, (folder, problems)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folders = sorted(p.parent for p in args.root.resolve().glob(f"*/*/{MARKER}") if p.parent.parent.name != "runs")
    entries = [entry for folder in folders for entry in (load(folder) or {}).values()]
    size = sum(e["size"] for e in entries)
    print(f"{len(folders)} stage folders, {len(entries)} files, {size / 2**30:.2f} GiB")
    quick, full = timed(folders, False, args.repeats), timed(folders, True, args.repeats)
    print(f"{'check':<8}{'s':>8}{'vs full':>10}")
    print(f"{'quick':<8}{quick:>8.3f}{quick / full:>10.4f}")
    print(f"{'full':<8}{full:>8.3f}{1.0:>10.4f}")
    write_result("cache_check", {"quick_ms": round(quick * 1000, 1), "full_s": round(full, 2), "folders": len(folders),
                                 "files": len(entries), "gib": round(size / 2**30, 2)},
                 summary="per-hit check {quick_ms:.0f} ms vs every byte {full_s:.1f} s ({folders} stage folders, "
                         "{files} files, {gib:.1f} GiB)",
                 what="checking cached outputs against their manifests: the per-hit check vs every byte (`--verify`), "
                      "over a whole tiny chain's stage folders",
                 command="bench/bench_cache_check.py", details="#checking-cached-outputs-benchbench_cache_checkpy",
                 conditions={"repeats": args.repeats})


if __name__ == "__main__":
    main()
