"""Persistent worker subprocesses that answer one request at a time within a hard time and memory limit: the
bounded workers of math scoring (stages/agent/math_worker.py) and of page extraction
(stages/agent/search/extract_worker.py).

Why a subprocess: work on hostile input (a huge power inside sympy, a pathological HTML or PDF page) can run in C
code holding the GIL, where no signal or thread can stop it, and can take memory that only a process limit bounds.
A process can be killed.

Parent side: `WorkerPool(command, max_workers).request(message, payload, limit_s)` sends one JSON line (with
`payload` raw bytes after it, their length in the line as `payload_bytes`) to an idle worker and waits `limit_s`
for its one JSON line back. Past it the worker is killed (SIGKILL) and `WorkerLost` raised; a worker that dies on a
request is lost the same way; a replacement starts at once, so it warms up while the caller goes on. A worker's
first reply must be `{"ready": true}`: a call waits at most `START_LIMIT_S` for it (once per worker), and a worker
that cannot start at all raises `WorkerStartError` (an installation problem, never a per-request failure).

Worker side: `serve(handle, memory_limit_bytes, warm)` caps the process's address space (RLIMIT_AS), then for each
request sets its own CPU-time limit (RLIMIT_CPU) just above the request's `limit_s`, so a worker whose parent died
is ended by the kernel, not left spinning, and answers `handle(message, payload)`. Workers exit when their stdin
closes (the parent closed the pool, exited or died).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

START_LIMIT_S = 60.0
_ROOT = str(Path(__file__).resolve().parents[2])  # holds the `stages` package, for the worker's import path


class WorkerStartError(RuntimeError):
    """A worker could not start: the environment is broken, not the request."""


class WorkerLost(Exception):
    """The worker overran its limit or died on one request; it was killed and is replaced."""

    def __init__(self, message: str, returncode: int | None, overran: bool) -> None:
        super().__init__(message)
        self.returncode, self.overran = returncode, overran


class Worker:
    """One child process speaking JSON lines on its stdin / stdout."""

    def __init__(self, command: Sequence[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0, start_new_session=True)
        self.ready = False
        self._buffer = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, message: dict[str, Any], payload: bytes, limit_s: float, name: str,
            start_hint: str) -> dict[str, Any]:
        """The worker's reply to `message` (+ `payload`) within `limit_s`; else WorkerLost, the worker killed."""
        if not self.ready:
            if parse_line(self._read_line(time.monotonic() + START_LIMIT_S)).get("ready") is not True:
                self.kill()
                raise WorkerStartError(
                    f"the {name} worker ({' '.join(self.proc.args)}) did not start within {START_LIMIT_S:g} s (exit code "
                    f"{self.proc.returncode}); its stderr above says why. {start_hint}")
            self.ready = True
        line = json.dumps({**message, "limit_s": limit_s, "payload_bytes": len(payload)}).encode() + b"\n"
        try:
            for data in (memoryview(line), memoryview(payload)):  # no copy of a large payload
                while data:  # an idle worker is blocked reading its stdin: it takes all of it
                    data = data[os.write(self.proc.stdin.fileno(), data):]
        except OSError as err:
            self.kill()
            raise WorkerLost(f"the worker died before the request was sent ({err})", self.proc.returncode,
                             False) from None
        reply = parse_line(self._read_line(time.monotonic() + limit_s))
        if not reply:
            overran = self.alive()
            self.kill()
            raise WorkerLost(f"no reply within {limit_s:g} s" if overran else "the worker died on the request",
                             self.proc.returncode, overran)
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


def parse_line(line: bytes | None) -> dict[str, Any]:
    """A worker's JSON line; {} for none (it ended or overran) or for a line that is not a JSON object."""
    try:
        value = json.loads(line) if line is not None else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class WorkerPool:
    """Up to `max_workers` workers, started lazily (a single-threaded caller only ever starts one). `name` and
    `start_hint` make the error of a worker that cannot start (what it is, what to check)."""

    def __init__(self, command: Sequence[str], max_workers: int, name: str, start_hint: str = "") -> None:
        self.max_workers = max(1, max_workers)
        self.command = tuple(command)
        self.name, self.start_hint = name, start_hint
        self._idle: list[Worker] = []
        self._all: set[Worker] = set()
        self._free = threading.Condition()
        self._pid = os.getpid()
        self.restarts = 0

    def request(self, message: dict[str, Any], payload: bytes, limit_s: float) -> dict[str, Any]:
        """The reply of an idle worker (waiting for one as long as it takes) within `limit_s`; WorkerLost past
        it (the worker replaced)."""
        worker = self.acquire(None)
        assert worker is not None  # no wait limit
        return self.run(worker, message, payload, limit_s)

    def run(self, worker: Worker, message: dict[str, Any], payload: bytes, limit_s: float) -> dict[str, Any]:
        """`request` on a worker from `acquire`, which it gives back (or replaces)."""
        try:
            reply = worker.ask(message, payload, limit_s, self.name, self.start_hint)
        except WorkerLost:
            self._replace(worker)
            raise
        except BaseException:  # an interrupt or a worker that cannot start: never leave a child behind
            worker.kill()
            self._replace(worker, restart=False)
            raise
        if reply.get("restart"):  # the worker exits after this reply (a memory error may leave it unsound)
            worker.kill()
            self._replace(worker)
        else:
            self._release(worker)
        return reply

    def prestart(self) -> None:
        """Start one worker now (it imports while the caller does other work), unless one exists."""
        with self._free:
            if not self._all:
                worker = Worker(self.command)
                self._all.add(worker)
                self._idle.append(worker)

    def release(self, worker: Worker) -> None:
        """Give back a worker from `acquire` that was not `run`."""
        self._release(worker)

    def acquire(self, wait_s: float | None) -> Worker | None:
        """An idle worker (started if there is room); None when none was free within `wait_s` (None: no limit)."""
        until = None if wait_s is None else time.monotonic() + wait_s
        with self._free:
            if self._pid != os.getpid():  # a forked child must not share its parent's pipes: it starts its own
                self._pid, self._idle, self._all = os.getpid(), [], set()
            while not self._idle and len(self._all) >= self.max_workers:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._free.wait(left)
            if self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                self._all.discard(worker)  # died while idle (killed from outside, or exited after a memory error)
                worker.kill()
            worker = Worker(self.command)
            self._all.add(worker)
            return worker

    def _release(self, worker: Worker) -> None:
        with self._free:
            self._idle.append(worker)
            self._free.notify()

    def _replace(self, worker: Worker, restart: bool = True) -> None:
        """Drop a killed worker; start its replacement now, so that it warms up while the caller goes on."""
        with self._free:
            self._all.discard(worker)
            if restart:
                self.restarts += 1
                fresh = Worker(self.command)
                self._all.add(fresh)
                self._idle.append(fresh)
            self._free.notify()

    def close(self) -> None:
        with self._free:
            workers, self._all, self._idle = list(self._all), set(), []
        for worker in workers:
            worker.kill()


def _limit_cpu(seconds: float) -> None:
    """The kernel ends this worker (SIGXCPU) once it spends `seconds` more CPU time: the bound holds even when
    no parent is left to kill it. Only the soft limit moves (an unprivileged process cannot raise the hard)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used.ru_utime + used.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def serve(handle: Callable[[dict[str, Any], bytes], dict[str, Any]], memory_limit_bytes: int,
          warm: Callable[[], None] | None = None) -> None:
    """The worker: one request per stdin line (+ its payload) -> one JSON reply per stdout line, until stdin
    closes. `handle` must answer every request with a dict; an exception it lets out ends the worker (the parent
    sees it as lost); a reply with `"restart": true` ends it after that reply (the parent starts another). `warm`
    runs once before the worker says it is ready (imports, caches)."""
    import resource
    import signal

    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from a library must not corrupt the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; it closes our stdin
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or hard > memory_limit_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))  # SIGXCPU: no core
    if warm is not None:
        warm()
    channel.write(json.dumps({"ready": True}) + "\n")
    stdin = sys.stdin.buffer
    while line := stdin.readline():
        message = json.loads(line)
        payload = stdin.read(message.get("payload_bytes", 0))
        _limit_cpu(float(message.get("limit_s", 60.0)) + 1)
        reply = handle(message, payload)
        channel.write(json.dumps(reply) + "\n")
        if reply.get("restart"):
            break
