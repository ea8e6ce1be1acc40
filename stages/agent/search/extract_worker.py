"""Page text extraction (HTML, PDF) in bounded worker processes (the shared machinery: stages/agent/worker_pool.py).

Why: parsing is where a hostile page's cost hides inside the byte cap (a page of unterminated tags, millions of
nested elements, a PDF whose pages share one costly content stream), partly in C code that no signal stops.

    extractor = Extractor(cfg)                            # cfg: BrowseSection; a worker starts warming up now
    text = extractor.extract("html", body, charset, deadline)   # or "pdf"; a PageFailure when over a limit

Per page: the worker gets `extract_timeout_s`, within the page's time left. Inside it that is a soft limit
(SIGALRM on the worker's main thread: the page fails as `extract_timeout`, the worker stays) and each PDF page
gets at most `pdf_page_timeout_s` (a slower page is skipped); `KILL_GRACE_S` past it (C code holds the GIL and
no signal is seen) the worker is killed and replaced (`extract_timeout` too); the kill comes by the page's
deadline at the latest. Each worker's address space is capped at `extract_memory_mb` (RLIMIT_AS): a page
that needs more fails as `extract_memory` and the worker is replaced. Up to `extract_workers` workers per fetcher;
a page waits for a free one only within its own time limit (else a transient `timeout`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from stages.agent.search.extract import ExtractError, Overrun, html_to_text, pdf_to_text, time_limit
from stages.agent.search.wire import Deadline, PageFailure
from stages.agent.worker_pool import WorkerLost, WorkerPool
from stages.core.config.browse import BrowseSection

KILL_GRACE_S = 1.0


class Extractor:
    """`command` starts one worker (tests give a stand-in that hangs in C code)."""

    def __init__(self, cfg: BrowseSection, command: tuple[str, ...] | None = None) -> None:
        self.cfg = cfg
        command = command or (sys.executable, "-m", __name__, str(cfg.extract_memory_mb << 20))
        self._pool = WorkerPool(command, cfg.extract_workers, "page extraction", start_hint="Check that lxml, "
                                "pypdf and charset_normalizer import in this environment: "
                                f"{sys.executable} -c 'import lxml.html, pypdf, charset_normalizer'")
        self._pool.prestart()

    @property
    def restarts(self) -> int:
        return self._pool.restarts

    def extract(self, kind: str, body: bytes, charset: str | None, deadline: Deadline) -> str:
        """The text of an `html` or `pdf` body within the page's deadline and the extraction limits."""
        worker = self._pool.acquire(wait_s=deadline.remaining())
        if worker is None:
            raise PageFailure("timeout", "no extraction worker was free within the page's time limit", True)
        left = deadline.left()
        if left <= 0:
            self._pool.release(worker)
            raise PageFailure("timeout", f"the page's {deadline.seconds:g} s limit ran out before extraction", True)
        # the kill lands by the page's deadline: its limit holds in all, extraction included
        hard_s = min(self.cfg.extract_timeout_s + KILL_GRACE_S, left)
        soft_s = max(hard_s - KILL_GRACE_S, hard_s / 2)
        message = {"kind": kind, "charset": charset, "soft_s": soft_s, "max_chars": self.cfg.max_text_chars,
                   "pdf_max_pages": self.cfg.pdf_max_pages, "pdf_max_words": self.cfg.pdf_max_words,
                   "pdf_page_timeout_s": self.cfg.pdf_page_timeout_s}
        try:
            reply = self._pool.run(worker, message, body, hard_s)
        except WorkerLost as lost:
            if lost.overran:
                raise PageFailure("extract_timeout", f"extraction overran {hard_s:.3g} s: its worker was "
                                  "killed") from None
            raise PageFailure("extract_failed", f"the extraction worker died on this page ({lost}, exit code "
                              f"{lost.returncode})") from None
        if "error" in reply:
            raise PageFailure(str(reply.get("kind", "extract_failed")), str(reply["error"]))
        return str(reply["text"])

    def close(self) -> None:
        self._pool.close()


def _extract(message: dict[str, Any], body: bytes) -> dict[str, Any]:
    """One page in the worker: its text, or the failure's kind and message (a memory error ends the worker)."""
    deadline = time.monotonic() + message["soft_s"]
    try:
        if message["kind"] == "pdf":
            text = pdf_to_text(body, message["pdf_max_pages"], message["pdf_max_words"], deadline,
                               message["pdf_page_timeout_s"])
        else:
            with time_limit(message["soft_s"]):
                text = html_to_text(body, message["charset"], message["max_chars"])
    except Overrun:
        return {"kind": "extract_timeout", "error": f"extraction took over {message['soft_s']:.3g} s"}
    except ExtractError as err:
        return {"kind": err.kind, "error": str(err)}
    except MemoryError:
        return {"kind": "extract_memory", "error": "extraction needed more than the worker's memory limit",
                "restart": True}
    return {"text": text}


def _warm() -> None:
    import charset_normalizer  # noqa: F401 - imported before the worker says it is ready
    import lxml.html  # noqa: F401
    import pypdf  # noqa: F401


if __name__ == "__main__":
    from stages.agent.worker_pool import serve

    serve(_extract, int(sys.argv[1]), _warm)
