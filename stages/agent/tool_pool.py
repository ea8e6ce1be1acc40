"""The tool thread pool of one process: calls run at once up to `threads`, none waits forever, and each call's
wait for a thread is measured.

    pool = ToolPool(threads=64, timeout_s=300.0)
    results = pool.map(run, items, on_timeout)   # run(item, queued_s) -> result; in the order of `items`

A call that started and has not returned `timeout_s` later gets `on_timeout(item, queued_s)` as its result (the
ToolBox makes that an infrastructure failure of the call: the trajectory is masked and counted like any other
provider, server or sandbox failure). Python cannot kill a thread, so the stuck thread is abandoned: the pool is
retired and a fresh one with the full thread count takes every later call, and the retired pool's calls that had
not started yet move to it, so a pool whose threads all hang cannot hold the rollout. The wait for a thread
(`queued_s`, from submission to the call's start) is handed to `run`, which adds the rate limiter's wait.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from stages.core.log import get_logger

log = get_logger(__name__)
Item = TypeVar("Item")
Result = TypeVar("Result")
MAX_TICK_S = 1.0   # how often a caller looks again at calls that have not started (a retired pool's queue)


class _Call:
    """One submitted call: its future, its pool, when it was submitted and when a thread took it."""

    def __init__(self, item: Any) -> None:
        self.item, self.future, self.pool = item, None, None
        self.submitted = time.monotonic()
        self.started: float | None = None


class ToolPool:
    def __init__(self, threads: int, timeout_s: float | None, name: str = "toolbox") -> None:
        self.threads, self.timeout_s, self.name = threads, timeout_s, name
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        self.retired = 0   # pools given up on after a call overran timeout_s (each left a stuck thread)
        self.timeouts = 0

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=self.name)

    def _submit(self, call: _Call, run: Callable[[Any, float], Any]) -> None:
        def body() -> Any:
            call.started = time.monotonic()
            return run(call.item, call.started - call.submitted)

        with self._lock:
            call.pool, call.future = self._pool, self._pool.submit(body)

    def _retire(self, pool: ThreadPoolExecutor) -> None:
        """Give up on `pool` (a thread of it is stuck): later calls go to a fresh pool."""
        with self._lock:
            if self._pool is pool:
                self._pool = self._new_pool()
                self.retired += 1
                pool.shutdown(wait=False)   # its stuck thread is left behind; its queued calls move (map)

    def map(self, run: Callable[[Item, float], Result], items: Sequence[Item],
            on_timeout: Callable[[Item, float], Result]) -> list[Result]:
        """`run(item, queued_s)` for every item, concurrently; a call past timeout_s since it started gives
        `on_timeout(item, running_s)` instead. Results in the order of `items`."""
        calls = [_Call(item) for item in items]
        for call in calls:
            self._submit(call, run)
        results: dict[int, Any] = {}
        while len(results) < len(calls):
            pending = {i: c for i, c in enumerate(calls) if i not in results}
            now = time.monotonic()
            for i, call in pending.items():
                if call.future.done():
                    results[i] = call.future.result()
                elif call.started is not None and self.timeout_s is not None and \
                        now - call.started >= self.timeout_s:
                    results[i] = on_timeout(call.item, now - call.started)
                    self.timeouts += 1
                    log.error("a %s call overran its %g s limit; its thread is abandoned and the pool replaced",
                              self.name, self.timeout_s)
                    self._retire(call.pool)
                elif call.started is None and call.pool is not self._pool and call.future.cancel():
                    self._submit(call, run)   # queued in a retired pool: the fresh one runs it
            waiting = [c.future for i, c in pending.items() if i not in results]
            if waiting:
                wait(waiting, timeout=self._tick(pending.values()), return_when=FIRST_COMPLETED)
        return [results[i] for i in range(len(calls))]

    def _tick(self, calls: Any) -> float:
        """Seconds until the earliest running call's limit (at most MAX_TICK_S)."""
        if self.timeout_s is None:
            return MAX_TICK_S
        now = time.monotonic()
        left = [c.started + self.timeout_s - now for c in calls if c.started is not None]
        return max(0.0, min([MAX_TICK_S, *left]))

    async def arun(self, run: Callable[[float], Result], on_timeout: Callable[[float], Result]) -> Result:
        """One call for an event loop: `run(queued_s)` on the pool, or `on_timeout(running_s)` past timeout_s
        since it started (as `map`)."""
        call = _Call(None)
        self._submit(call, lambda _, queued: run(queued))
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call.future)),
                                              max(0.01, self._tick([call])))
            except TimeoutError:
                pass
            if call.started is not None and self.timeout_s is not None and \
                    time.monotonic() - call.started >= self.timeout_s:
                self.timeouts += 1
                self._retire(call.pool)
                return on_timeout(time.monotonic() - call.started)
            if call.started is None and call.pool is not self._pool and call.future.cancel():
                self._submit(call, lambda _, queued: run(queued))

    def close(self) -> None:
        """Wait for the running calls unless a call was abandoned (its thread may never return)."""
        with self._lock:
            pool = self._pool
        pool.shutdown(wait=self.retired == 0, cancel_futures=self.retired > 0)
