"""A small stage for the live-reporting tests: it logs at two levels, prints like a library (a tqdm bar, a plain
line, a repeated warning), tracks progress over `n` units and publishes a markdown message and an event, so the
same calls can be checked in-process and under another interpreter (stages.core.isolate)."""

from __future__ import annotations

import sys

from stages.core import reporter
from stages.core.log import get_logger

log = get_logger("tests.live_stage")


def count(n: int) -> int:
    log.info("counting %d units", n)
    log.warning("careful: unit %d is the last", n)
    for _ in range(2):
        print("UserWarning: a library repeats itself", file=sys.stderr, flush=True)
    print(" 50%|#####     | 1/2 [00:01<00:01,  1.00it/s]", flush=True)
    print("plain library line", flush=True)
    with reporter.track("count", "count", total=n, unit="units", report_every_s=0.0) as bar:
        for _ in range(n):
            bar.advance(note="counting")
    reporter.markdown("count-report", f"counted **{n}**", "what the count stage found")
    reporter.event("arpo.test.counted", {"n": n})
    return n
