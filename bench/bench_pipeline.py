"""Wall time of the whole tiny pipeline, cold, then a fully cached rerun, the same checking every cached byte
(`arpo run --verify`), then a rerun refreshing only `eval`.

All three in one process against one Prefect server (an ephemeral one unless PREFECT_API_URL is set), outputs and
Prefect results in a fresh temp folder so the first run computes everything. Prints the ratios to the cold run.

    .venv/bin/python bench/bench_pipeline.py [-o key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from stages.core.env import configure_environment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--override", action="append", default=[])
    parser.add_argument("-p", "--profile", default="tiny-cpu")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="arpo-bench-"))
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp / "prefect-results")
    configure_environment()
    if not os.environ.get("PREFECT_API_URL"):  # ephemeral unless set (else prefect.toml's project server)
        from flows.server import start_ephemeral_server

        start_ephemeral_server()
    from flows.pipeline import pipeline

    overrides = [f"run.output_root={tmp / 'outputs'}", *args.override]
    timings = {}
    runs = (("cold", None, False), ("cached rerun", None, False), ("cached --verify", None, True),
            ("refresh eval", ["eval"], False))
    for label, refresh, verify in runs:
        start = time.perf_counter()
        pipeline(profile=args.profile, overrides=overrides, refresh=refresh, verify=verify)
        timings[label] = time.perf_counter() - start
    cold = timings["cold"]
    print(f"\n{'run':<16}{'wall s':>10}{'vs cold':>10}")
    for label, seconds in timings.items():
        print(f"{label:<16}{seconds:>10.1f}{seconds / cold:>10.3f}")
    print(f"outputs in {tmp}")
    write_result("pipeline", {"cold_s": round(cold, 1), "cached_rerun_s": round(timings["cached rerun"], 1),
                              "cached_verify_s": round(timings["cached --verify"], 1),
                              "refresh_eval_s": round(timings["refresh eval"], 1)},
                 summary="cold {cold_s:.0f} s; fully cached rerun {cached_rerun_s:.1f} s in process (the flow alone: "
                         "no interpreter start or imports, and no model server); the same with `--verify` "
                         "{cached_verify_s:.1f} s; refresh `eval` {refresh_eval_s:.0f} s",
                 what="the whole tiny pipeline in one process: cold, fully cached rerun, the same with `--verify`, "
                      "refresh `eval`",
                 command="bench/bench_pipeline.py",
                 conditions={"profile": args.profile, "overrides": args.override,
                             "server": os.environ.get("PREFECT_API_URL") or "ephemeral"})


if __name__ == "__main__":
    main()
