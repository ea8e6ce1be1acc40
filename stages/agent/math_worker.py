"""math-verify in persistent worker subprocesses, so that an answer costs at most a fixed time from any thread.

Why a subprocess: math-verify bounds its work with `signal.alarm`, which only the main thread can set (verl calls
the reward from its reward workers' threads), and a signal is only seen between bytecodes, so a huge integer
power inside sympy (`10^{10^{10}}`) runs on holding the GIL wherever it was started. A process can be killed.

`worker_equivalent(pred, golds, timeout_s)` sends the (pre-screened) texts to an idle worker of this process's
pool (the shared worker machinery: stages/agent/worker_pool.py) and waits `timeout_s + KILL_GRACE_S` for its
verdict:
- the worker scores with `math_local.equivalent_here` (screened again) on its main thread, whose soft
  `timeout_s` timer ends ordinary slow answers without a restart;
- past the grace the worker is killed (SIGKILL), a replacement starts warming up at once, and the answer scores
  False; a worker that dies on an answer (memory cap: `MEMORY_LIMIT_BYTES`) is replaced the same way;
- each request also sets the worker's own CPU-time limit (RLIMIT_CPU) just above the bound, so a worker whose
  caller died is ended by the kernel, not left spinning.
A call waits at most `START_LIMIT_S` more for a worker that is still starting (once per process, and after a
kill), and, with more concurrent callers than `MAX_WORKERS`, for a free worker. A worker that cannot start at
all is an installation problem and raises `MathWorkerError` (every answer would otherwise score 0 silently).
Verdicts are memoised per process (`lru_cache`): an RL group repeats answers, and a hostile one costs once.
Workers exit when this process closes their stdin (at exit, or when it dies); a forked child starts its own pool.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from stages.agent.math_local import equivalent_here
from stages.agent.worker_pool import WorkerLost, WorkerPool, WorkerStartError

KILL_GRACE_S = 1.0
MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
MEMORY_LIMIT_BYTES = 4 << 30
CACHE_SIZE = 8192
WORKER_COMMAND = (sys.executable, "-m", __name__)


class MathWorkerError(WorkerStartError):
    """The scoring worker could not start: the environment is broken, not the answer."""


class MathWorkerPool:
    """Up to `max_workers` workers (stages/agent/worker_pool.py), started lazily (a single-threaded caller only
    ever starts one). `command` starts one worker (tests give a stand-in that hangs on demand)."""

    def __init__(self, max_workers: int = MAX_WORKERS, command: Sequence[str] = WORKER_COMMAND) -> None:
        self._pool = WorkerPool(command, max_workers, "math scoring", start_hint="Check that math-verify imports "
                                f"in this environment: {sys.executable} -c 'import math_verify'")

    @property
    def restarts(self) -> int:
        return self._pool.restarts

    @property
    def _all(self) -> set[Any]:
        return self._pool._all

    def equivalent(self, pred: str, golds: list[str], timeout_s: float) -> tuple[bool, str | None]:
        """(math-verify's verdict, None) or (False, why no verdict)."""
        limit_s = timeout_s + KILL_GRACE_S
        try:
            reply = self._pool.request({"pred": pred, "golds": golds, "timeout_s": timeout_s}, b"", limit_s)
        except WorkerLost as lost:
            from stages.core.log import get_logger

            why = f"no verdict within {limit_s:g} s (worker exit code {lost.returncode})" if lost.overran else \
                f"{lost} (exit code {lost.returncode})"
            get_logger(__name__).warning("math-verify: %s for the answer %r; scored as not equal, worker "
                                         "restarted", why, pred[:80])
            return False, why
        except WorkerStartError as err:
            raise MathWorkerError(str(err)) from None
        return bool(reply.get("equal")), reply.get("error")

    def close(self) -> None:
        self._pool.close()


_POOL: tuple[int, MathWorkerPool] | None = None
_POOL_LOCK = threading.Lock()


def pool() -> MathWorkerPool:
    """This process's pool (a forked child must not share its parent's pipes: it gets a new one)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), MathWorkerPool())
            atexit.register(_POOL[1].close)
        return _POOL[1]


@lru_cache(maxsize=CACHE_SIZE)
def worker_equivalent(pred: str, golds: tuple[str, ...], timeout_s: float) -> bool:
    """math-verify's verdict on pre-screened texts, bounded (module docstring). MathWorkerError is not cached."""
    return pool().equivalent(pred, list(golds), timeout_s)[0]


def _score(request: dict[str, Any], _payload: bytes) -> dict[str, Any]:
    try:
        return {"equal": equivalent_here(request["pred"], request["golds"], request["timeout_s"])}
    except BaseException as err:  # noqa: BLE001 - any failure on one answer is a verdict of "not equal"
        return {"equal": False, "error": f"{type(err).__name__}: {str(err)[:200]}"}


def _warm() -> None:
    equivalent_here("1", ["1"])  # imports and warms sympy before the first real answer


if __name__ == "__main__":
    from stages.agent.worker_pool import serve

    serve(_score, MEMORY_LIMIT_BYTES, _warm)
