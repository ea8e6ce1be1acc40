"""math-verify in persistent worker subprocesses, so that an answer costs at most a fixed time from any thread.

Why a subprocess: math-verify bounds its work with `signal.alarm`, which only the main thread can set (verl calls
the reward from its reward workers' threads), and a signal is only seen between bytecodes, so a huge integer
power inside sympy (`10^{10^{10}}`) runs on holding the GIL wherever it was started. A process can be killed.

`worker_equivalent(pred, golds, timeout_s)` sends the (pre-screened) texts to an idle worker of this process's
pool and waits `timeout_s + KILL_GRACE_S` for its verdict:
- the worker scores with `answer_match.math_equivalent_local` on its main thread, whose soft `timeout_s` timer
  ends ordinary slow answers without a restart;
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
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

KILL_GRACE_S = 1.0
START_LIMIT_S = 60.0
MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
MEMORY_LIMIT_BYTES = 4 << 30
CACHE_SIZE = 8192
_ROOT = str(Path(__file__).resolve().parents[2])  # holds the `stages` package, for the worker's import path
WORKER_COMMAND = (sys.executable, "-m", __name__)


class MathWorkerError(RuntimeError):
    """The scoring worker could not start: the environment is broken, not the answer."""


class _Lost(Exception):
    """The worker overran or died on one answer: it is replaced and the answer scores False."""


class _Worker:
    """One `python -m stages.agent.math_worker` child speaking JSON lines on its stdin / stdout."""

    def __init__(self, command: Sequence[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0, start_new_session=True)
        self.ready = False
        self._buffer = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: dict[str, Any], limit_s: float) -> dict[str, Any]:
        if not self.ready:
            if _parse(self._read_line(time.monotonic() + START_LIMIT_S)).get("ready") is not True:
                self.kill()
                raise MathWorkerError(
                    f"the math scoring worker ({' '.join(self.proc.args)}) did not start within "
                    f"{START_LIMIT_S:g} s (exit code {self.proc.returncode}); its stderr above says why. Check "
                    f"that math-verify imports in this environment: {sys.executable} -c 'import math_verify'")
            self.ready = True
        data = memoryview(json.dumps(request).encode() + b"\n")
        try:
            while data:  # an idle worker is blocked reading its stdin, so this cannot block for long
                data = data[os.write(self.proc.stdin.fileno(), data):]
        except OSError as err:
            self.kill()
            raise _Lost(f"the worker died before the answer was sent ({err})") from None
        reply = _parse(self._read_line(time.monotonic() + limit_s))
        if "equal" not in reply:
            self.kill()
            raise _Lost(f"no verdict within {limit_s:g} s (worker exit code {self.proc.returncode})")
        return reply

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line of the worker's stdout, or None when it ends or the deadline passes (poll, not select:
        a Ray worker may hold more than 1024 descriptors)."""
        poller = select.poll()
        poller.register(self.proc.stdout.fileno(), select.POLLIN)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


def _parse(line: bytes | None) -> dict[str, Any]:
    """A worker's JSON line; {} for none (it ended or overran) or for a line that is not a JSON object."""
    try:
        value = json.loads(line) if line is not None else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MathWorkerPool:
    """Up to `max_workers` workers, started lazily (a single-threaded caller only ever starts one).
    `command` starts one worker (tests give a stand-in that hangs on demand)."""

    def __init__(self, max_workers: int = MAX_WORKERS, command: Sequence[str] = WORKER_COMMAND) -> None:
        self.max_workers = max(1, max_workers)
        self.command = tuple(command)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._free = threading.Condition()
        self.restarts = 0

    def equivalent(self, pred: str, golds: list[str], timeout_s: float) -> tuple[bool, str | None]:
        """(math-verify's verdict, None) or (False, why no verdict)."""
        worker = self._acquire()
        try:
            reply = worker.ask({"pred": pred, "golds": golds, "timeout_s": timeout_s}, timeout_s + KILL_GRACE_S)
        except _Lost as lost:
            self._replace(worker)
            from stages.core.log import get_logger

            get_logger(__name__).warning("math-verify: %s for the answer %r; scored as not equal, worker "
                                         "restarted", lost, pred[:80])
            return False, str(lost)
        except BaseException:  # an interrupt or a worker that cannot start: never leave a child behind
            worker.kill()
            self._replace(worker, restart=False)
            raise
        self._release(worker)
        return bool(reply.get("equal")), reply.get("error")

    def _acquire(self) -> _Worker:
        with self._free:
            while not self._idle and len(self._all) >= self.max_workers:
                self._free.wait()
            if self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                self._all.discard(worker)  # died while idle (killed from outside): start another
            worker = _Worker(self.command)
            self._all.add(worker)
            return worker

    def _release(self, worker: _Worker) -> None:
        with self._free:
            self._idle.append(worker)
            self._free.notify()

    def _replace(self, worker: _Worker, restart: bool = True) -> None:
        """Drop a killed worker; start its replacement now, so that it warms up while the caller goes on."""
        with self._free:
            self._all.discard(worker)
            if restart:
                self.restarts += 1
                fresh = _Worker(self.command)
                self._all.add(fresh)
                self._idle.append(fresh)
            self._free.notify()

    def close(self) -> None:
        with self._free:
            workers, self._all, self._idle = list(self._all), set(), []
        for worker in workers:
            worker.kill()


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


def _limit_cpu(seconds: float) -> None:
    """The kernel ends this worker (SIGXCPU) once it spends `seconds` more CPU time: the bound holds even when
    no parent is left to kill it. Only the soft limit moves (an unprivileged process cannot raise the hard)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used.ru_utime + used.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def serve() -> None:
    """The worker: one JSON request per stdin line -> one JSON verdict per stdout line, until stdin closes."""
    import resource
    import signal

    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from sympy must not corrupt the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; it closes our stdin
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or hard > MEMORY_LIMIT_BYTES:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))  # SIGXCPU: no core
    from stages.agent.answer_match import math_equivalent_local

    math_equivalent_local("1", ["1"])  # imports and warms sympy before the first real answer
    channel.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        _limit_cpu(request["timeout_s"] + KILL_GRACE_S + 1)
        try:
            reply = {"equal": math_equivalent_local(request["pred"], request["golds"], request["timeout_s"])}
        except BaseException as err:  # noqa: BLE001 - any failure on one answer is a verdict of "not equal"
            reply = {"equal": False, "error": f"{type(err).__name__}: {str(err)[:200]}"}
        channel.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve()
