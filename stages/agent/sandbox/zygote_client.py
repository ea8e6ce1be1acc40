"""Host side of the sandbox's warm parent (the zygote in child/zygote_server.py): start it, hand it calls, restart
it when it dies. Stdlib only and free of config models, so tests can drive it from any interpreter.

One `WarmParent` holds one zygote process (inside bubblewrap, or on the host in the rlimit mode) and is safe
to share between threads; each call sends one control message (SOCK_SEQPACKET) carrying four descriptors:
the code (a memfd), stdout and stderr (memfds, capped by RLIMIT_FSIZE in the call) and the write end of a
status pipe on which the call reports its isolation facts and the zygote its exit status.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from stages.agent.sandbox.child import isolation, zygote_server
from stages.agent.sandbox.spec import (
    CALL_MOUNTS,
    SANDBOX_DIR,
    InterpreterPaths,
    bwrap_args,
    call_rebinds,
    landlock_reads,
)

# one program for `python -c` (the sandbox sees no project files): the isolation steps, then the zygote
RUNNER_SOURCE = "\n".join(Path(m.__file__).read_text(encoding="utf-8") for m in (isolation, zygote_server))
ANSWER_GRACE_S = 10.0  # beyond the call's own timeout, which the zygote enforces, before the host gives up on it


def zygote_argv(mode: str, settings: dict, paths: InterpreterPaths, privileged: bool) -> list[str]:
    """The command line of a zygote. `settings`: preload, timeout_s, seed, workdir_mb and limits (cpu_s, memory_mb,
    max_processes, max_file_mb, max_open_files), as in PythonToolSection. `-s` and not `-I`: -I would ignore
    PYTHONHASHSEED, which a seeded configuration sets; the environment is ours entirely (sandbox_env)."""
    spec = {**settings, "mode": mode, "sandbox_dir": SANDBOX_DIR, "call_mounts": list(CALL_MOUNTS),
            "rebind": call_rebinds(paths), "landlock": True, "landlock_reads": landlock_reads(paths)}
    binary = shutil.which("bwrap") or "bwrap"  # resolved with the pipeline's PATH, not the sandbox's
    prefix = bwrap_args(paths, privileged, settings["workdir_mb"], binary) if mode == "bwrap" else []
    return [*prefix, paths.executable, "-s", "-c", RUNNER_SOURCE, json.dumps(spec)]


@dataclass
class CallOutcome:
    """What came back from one call. `exit`: the zygote's exit record, None when it never answered."""

    facts: dict = field(default_factory=dict)
    exit: dict | None = None
    stdout_fd: int = -1
    stderr_fd: int = -1
    lost: str = ""  # why there is no exit record

    def close(self) -> None:
        for fd in (self.stdout_fd, self.stderr_fd):
            if fd >= 0:
                os.close(fd)
        self.stdout_fd = self.stderr_fd = -1


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd


class ZygoteClient:
    """The host's end of one zygote process (a `ZygoteServer`, child/zygote_server.py): the process and its
    control socket."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control = ours
        self.log_fd = os.memfd_create("arpo-zygote-log", os.MFD_CLOEXEC)
        spec = json.loads(argv[-1])
        spec["control_fd"] = theirs.fileno()
        argv = [*argv[:-1], json.dumps(spec)]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log_fd, stderr=self.log_fd,
                                         pass_fds=(theirs.fileno(),), start_new_session=True, env=env, cwd=cwd)
        finally:
            theirs.close()
        self.ready: dict | None = None
        self.failed = ""
        self._ready_lock = threading.Lock()
        self._send_lock = threading.Lock()

    def wait_ready(self, deadline: float) -> bool:
        with self._ready_lock:
            if self.ready is None and not self.failed:
                poller = select.poll()
                poller.register(self.control.fileno(), select.POLLIN)
                if poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    message = self.control.recv(65536)
                    if message:
                        self.ready = json.loads(message)
                    else:
                        self.failed = "the sandbox's interpreter exited while starting"
            return self.ready is not None

    def send(self, request: dict, fds: list[int]) -> None:
        with self._send_lock:
            socket.send_fds(self.control, [json.dumps(request).encode()], fds)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.failed

    def log_tail(self, limit: int = 2000) -> str:
        size = os.fstat(self.log_fd).st_size
        return os.pread(self.log_fd, limit, max(0, size - limit)).decode("utf-8", "replace").strip()

    def stop(self) -> None:
        self.control.close()  # the zygote sees EOF: it kills its calls and exits
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(timeout=10)
        os.close(self.log_fd)


class WarmParent:
    """A zygote that is always there (started ahead, restarted after it dies); `call(code, request)`.

    The zygote is started by one long-lived thread: bubblewrap's --die-with-parent fires when the *thread* that
    forked it exits, so a short-lived caller thread would take the sandbox down with it.
    """

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None, startup_timeout_s: float,
                 timeout_s: float) -> None:
        self.argv, self.env, self.cwd = argv, env, cwd
        self.startup_timeout_s, self.timeout_s = startup_timeout_s, timeout_s
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")
        self._lock = threading.Lock()
        self._closed = False
        self._zygote: ZygoteClient | None = None
        self._pid = os.getpid()
        self.restarts = 0
        self._current()

    def _current(self) -> ZygoteClient:
        if os.getpid() != self._pid:
            raise RuntimeError(f"this PythonSandbox belongs to process {self._pid}; a forked process must create "
                               "its own (its warm parent and threads did not come along)")
        with self._lock:
            if self._closed:
                raise RuntimeError("PythonSandbox is closed")
            if self._zygote is not None and not self._zygote.alive():
                self._retire(self._zygote)
                self.restarts += 1
            if self._zygote is None:
                self._zygote = self._spawner.submit(ZygoteClient, self.argv, self.env, self.cwd).result()
            return self._zygote

    def _retire(self, zygote: ZygoteClient) -> None:
        """Stop `zygote` unless another thread did already (call with the lock held)."""
        if self._zygote is zygote:
            self._zygote = None
            self._on_spawner(zygote.stop, wait=False)

    def _on_spawner(self, fn, wait: bool) -> None:
        try:
            future = self._spawner.submit(fn)
        except RuntimeError:  # interpreter shutdown: executors are closed before atexit handlers run
            fn()
            return
        if wait:
            future.result()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._current().wait_ready(time.monotonic() + timeout_s)

    def startup_error(self) -> str:
        zygote = self._zygote
        if zygote is None:
            return ""
        return "\n".join(p for p in (zygote.failed, zygote.log_tail()) if p)

    def call(self, code: bytes, request: dict) -> CallOutcome:
        zygote = self._current()
        if not zygote.wait_ready(time.monotonic() + self.startup_timeout_s):
            reason = f"the python sandbox failed to start: {zygote.failed or 'no answer'}\n{zygote.log_tail()}"
            with self._lock:
                self._retire(zygote)
            return CallOutcome(lost=reason.strip())
        outcome = CallOutcome(stdout_fd=_memfd("arpo-py-stdout"), stderr_fd=_memfd("arpo-py-stderr"))
        code_fd = _memfd("arpo-py-code", code)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            zygote.send(request, [code_fd, outcome.stdout_fd, outcome.stderr_fd, write_end])
        except OSError as err:
            outcome.lost = f"the python sandbox stopped before this call ({err})"
        finally:
            os.close(code_fd)
            os.close(write_end)
        try:
            if not outcome.lost:
                self._collect(read_end, outcome, time.monotonic() + self.timeout_s + ANSWER_GRACE_S)
        finally:
            os.close(read_end)
        if outcome.exit is None and not outcome.lost:
            outcome.lost = "the python sandbox stopped during this call"
        if outcome.lost.startswith("no answer"):
            with self._lock:
                self._retire(zygote)  # hung: its calls die with it
        return outcome

    @staticmethod
    def _collect(fd: int, outcome: CallOutcome, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        buffer = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                outcome.lost = "no answer from the python sandbox within its timeout"
                return
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buffer += chunk
        for line in buffer.decode("utf-8", "replace").splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if "facts" in record:
                outcome.facts = record["facts"]
            elif "exit" in record:
                outcome.exit = record

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if os.getpid() != self._pid:  # a forked copy: the zygote is the creator's to stop
                return
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            self._on_spawner(zygote.stop, wait=True)
        self._spawner.shutdown(wait=True)
