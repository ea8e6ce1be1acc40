"""Run model-written python in a separate, isolated, resource-limited interpreter.

Two isolation levels, chosen by `PythonToolSection.sandbox` ("auto" picks the first that works here):
- `bwrap`: bubblewrap (Debian package `bubblewrap`): no network, new pid/ipc/uts namespaces, read-only system
  and interpreter folders, a size-capped tmpfs working dir, nothing else of the host visible.
- `rlimit` (fallback): a private temp working dir, a new network namespace when the kernel allows it, and,
  when the pipeline runs as root, an unprivileged uid. The result's `meta` says which level ran.
Both add rlimits (CPU, address space, processes, file size, open files), a wall-clock timeout and capped output.

Interpreters are started ahead (`pool_size`) with numpy/sympy already imported; each runs exactly one call
and is then discarded, so every call starts from a fresh process and an empty working dir.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from stages.agent import sandbox_runner
from stages.agent.sandbox_os import (
    SandboxUnavailable,
    interpreter_paths,
    is_root,
    kill_uid,
    probe_bwrap,
    read_capped,
    signal_of,
    wait_exit,
)
from stages.agent.sandbox_spec import SANDBOX_DIR, bwrap_args, prepare_code, sandbox_env
from stages.core.config.agent import PythonToolSection
from stages.core.log import get_logger

log = get_logger(__name__)
RUNNER_SOURCE = Path(sandbox_runner.__file__).read_text(encoding="utf-8")
_UID_SPAN = 100_000
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_sandboxes() -> None:
    """Discard pooled interpreters and their host folders of sandboxes nobody closed before exit."""
    for box in list(_LIVE):
        try:
            box.close()
        except Exception as err:  # noqa: BLE001 - keep closing the others
            log.warning("python sandbox: cleanup at exit failed: %s", err)


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one call. `status`: ok | error | timeout | cpu_limit | killed | refused | start_failed."""

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    duration_s: float
    meta: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def text(self) -> str:
        """What the model sees: stdout on success (as the reference), else output plus the error."""
        out, err = self.stdout.strip(), self.stderr.strip()
        if self.status == "ok":
            return out
        notes = {"timeout": f"Execution timed out after {self.meta.get('timeout_s')} s.",
                 "cpu_limit": f"CPU time limit of {self.meta.get('cpu_s')} s exceeded.",
                 "killed": f"The process was killed (exit status {self.returncode})."}
        parts = [p for p in (out, err, notes.get(self.status, "")) if p]
        return "\n".join(parts)


def resolve_mode(cfg: PythonToolSection) -> tuple[str, str]:
    """(mode, reason): the isolation level that will run under `cfg.sandbox` and why."""
    executable = cfg.python_executable or sys.executable
    if cfg.sandbox == "rlimit":
        return "rlimit", "configured"
    problem = probe_bwrap(executable, cfg.workdir_mb)
    if problem is None:
        return "bwrap", "bubblewrap works"
    if cfg.sandbox == "bwrap":
        raise SandboxUnavailable(f"agent.python.sandbox=bwrap but {problem}; install it or set sandbox: auto")
    return "rlimit", problem


def _readable(fd: int, timeout_s: float) -> bool:
    """poll(), not select(): select fails on descriptors above 1024, common in a busy eval process."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


class _Worker:
    """One interpreter waiting for its single piece of code."""

    def __init__(self, proc: subprocess.Popen, status_fd: int, tmp: Path, uid: int | None) -> None:
        self.proc, self.status_fd, self.tmp, self.uid = proc, status_fd, tmp, uid
        self.buffer = b""
        self.ready = False
        self._ready_lock = threading.Lock()

    def wait_ready(self, deadline: float) -> bool:
        """True once the interpreter reported that its preloads are done (False on death or deadline)."""
        with self._ready_lock:
            if not self.ready:
                self.ready = self.read_line(deadline) == "ready"
            return self.ready

    def read_line(self, deadline: float) -> str | None:
        """Next line from the status pipe, or None on EOF/deadline."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(self.status_fd, left):
                return None
            chunk = os.read(self.status_fd, 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")


class PythonSandbox:
    """Thread-safe runner of untrusted python; `run(code) -> ExecResult`. Close it (or use `with`)."""

    def __init__(self, cfg: PythonToolSection, host_tmp: str | Path | None = None) -> None:
        """`host_tmp`: where per-call host folders (output files, fallback working dir) go; None = system temp."""
        self.cfg = cfg
        self.host_tmp = str(host_tmp) if host_tmp is not None else None
        self.executable = cfg.python_executable or sys.executable
        self.mode, self.mode_reason = resolve_mode(cfg)
        self.paths = interpreter_paths(self.executable)
        self._lock = threading.Lock()
        self._pool: list[_Worker] = []
        self._closed = False
        self._counter = os.getpid() * 7919
        self._wake = threading.Event()
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-cleanup")
        _LIVE.add(self)
        if self.mode == "rlimit":
            log.warning("python sandbox: rlimit fallback (%s); bubblewrap gives stronger isolation", self.mode_reason)
        # Pooled interpreters are spawned by one long-lived thread: bwrap's --die-with-parent (PDEATHSIG) fires
        # when the *thread* that forked it exits, so a short-lived spawning thread would kill its workers.
        self._spawner = threading.Thread(target=self._spawn_loop, name="sandbox-spawner", daemon=True)
        if cfg.pool_size:
            self._spawner.start()
            self._wake.set()

    # ---- worker lifecycle ------------------------------------------------------------------------------
    def _next_uid(self) -> int | None:
        if not is_root():
            return None
        with self._lock:
            self._counter += 1
            return self.cfg.uid_base + self._counter % _UID_SPAN

    def _spawn(self) -> _Worker:
        cfg, uid = self.cfg, self._next_uid()
        tmp = Path(tempfile.mkdtemp(prefix="arpo-py-", dir=self.host_tmp))
        workdir = tmp / "work"
        workdir.mkdir()
        if uid is not None:
            os.chown(workdir, uid, uid)
        spec = {"preload": list(cfg.preload), "cpu_s": cfg.cpu_s, "memory_mb": cfg.memory_mb,
                "max_processes": cfg.max_processes, "max_file_mb": cfg.max_file_mb,
                "max_open_files": cfg.max_open_files, "uid": uid}
        read_fd, write_fd = os.pipe()
        spec["status_fd"] = write_fd
        if self.mode == "bwrap":
            prefix = bwrap_args(self.paths, is_root(), cfg.workdir_mb)
            spec.update(network="isolated", per_sandbox_nproc=True)
            home, cwd = SANDBOX_DIR, None
        else:
            prefix = []
            spec.update(network="unshare", per_sandbox_nproc=False)
            home, cwd = str(workdir), str(workdir)
        argv = prefix + [self.executable, "-I", "-c", RUNNER_SOURCE, json.dumps(spec)]
        with open(tmp / "stdout", "wb") as out, open(tmp / "stderr", "wb") as err:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=cwd,
                                        env=sandbox_env(home), pass_fds=(write_fd,), start_new_session=True)
            finally:
                os.close(write_fd)
        return _Worker(proc, read_fd, tmp, uid)

    def _spawn_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            try:
                self._fill()
            except Exception as err:  # noqa: BLE001 - a failed spawn shows up as a cold start later
                log.error("python sandbox: could not pre-start an interpreter: %s", err)
                time.sleep(1.0)

    def _fill(self) -> None:
        while True:
            with self._lock:
                if self._closed or len(self._pool) >= self.cfg.pool_size:
                    return
            worker = self._spawn()
            with self._lock:
                if self._closed:
                    self._discard(worker)
                    return
                self._pool.append(worker)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("PythonSandbox is closed")
            worker = self._pool.pop(0) if self._pool else None
        return worker or self._spawn()

    def _discard(self, worker: _Worker) -> None:
        if worker.proc.poll() is None:
            self._kill(worker)
        try:
            worker.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("sandbox process %d did not exit after SIGKILL", worker.proc.pid)
        if worker.proc.stdin:
            worker.proc.stdin.close()
        os.close(worker.status_fd)
        try:
            self._janitor.submit(shutil.rmtree, worker.tmp, ignore_errors=True)  # off the caller's critical path
        except RuntimeError:  # closed meanwhile
            shutil.rmtree(worker.tmp, ignore_errors=True)

    def _kill(self, worker: _Worker) -> None:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if worker.uid is not None:
            kill_uid(worker.uid)

    # ---- one call ------------------------------------------------------------------------------------------
    def run(self, code: str) -> ExecResult:
        """Run `code` (fences stripped, last bare expression printed) in a fresh interpreter."""
        if len(code) > self.cfg.max_code_chars:
            return ExecResult("refused", "", f"Code is {len(code)} characters; the limit is "
                              f"{self.cfg.max_code_chars}.", None, 0.0, self._meta({}))
        worker = self._take()
        self._wake.set()
        try:
            return self._execute(worker, prepare_code(code))
        finally:
            if worker.uid is not None:  # children the code left behind (a pid namespace ends them too)
                kill_uid(worker.uid)
            self._discard(worker)

    def _execute(self, worker: _Worker, code: str) -> ExecResult:
        cfg = self.cfg
        if not worker.wait_ready(time.monotonic() + cfg.startup_timeout_s):
            self._kill(worker)
            worker.proc.wait(timeout=10)
            err = (worker.tmp / "stderr").read_text(errors="replace")[-2000:]
            return ExecResult("start_failed", "", f"The python sandbox failed to start: {err.strip()}",
                              worker.proc.returncode, 0.0, self._meta({}))
        start = time.monotonic()
        try:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write(code.encode("utf-8", "replace"))
            worker.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        timed_out = not wait_exit(worker.proc, cfg.timeout_s)
        if timed_out:
            self._kill(worker)
            worker.proc.wait(timeout=10)
        duration = time.monotonic() - start
        facts_line = worker.read_line(time.monotonic() + 1.0)
        facts = json.loads(facts_line) if facts_line and facts_line.startswith("{") else {}
        return self._collect(worker, timed_out, duration, facts)

    def _collect(self, worker: _Worker, timed_out: bool, duration: float, facts: dict) -> ExecResult:
        cfg = self.cfg
        stdout, out_cut = read_capped(worker.tmp / "stdout", cfg.max_output_chars)
        stderr, err_cut = read_capped(worker.tmp / "stderr", cfg.max_output_chars)
        rc = worker.proc.returncode
        signum = signal_of(rc, self.mode)
        if timed_out:
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif signum == signal.SIGXCPU or (signum == signal.SIGKILL and duration >= cfg.cpu_s):
            status = "cpu_limit"
        elif signum:
            status = "killed"
        else:
            status = "error"
        size = (worker.tmp / "stdout").stat().st_size
        meta = self._meta({**facts, "uid": worker.uid, "truncated": out_cut or err_cut,
                           "output_limit_hit": size >= (cfg.max_file_mb << 20) - 65536})
        return ExecResult(status, stdout, stderr, rc, duration, meta)

    def _meta(self, extra: dict) -> dict:
        return {"sandbox": self.mode, "sandbox_reason": self.mode_reason, "timeout_s": self.cfg.timeout_s,
                "cpu_s": self.cfg.cpu_s, **extra}

    def wait_warm(self, timeout_s: float = 60.0) -> bool:
        """Block until the pool is full and every pooled interpreter has finished its preloads."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                pool = list(self._pool)
            if len(pool) >= self.cfg.pool_size and all(w.wait_ready(deadline) for w in pool):
                return True
            time.sleep(0.01)
        return False

    # ---- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, []
        self._wake.set()
        if self._spawner.is_alive() and self._spawner is not threading.current_thread():
            self._spawner.join(timeout=30)
        with self._lock:
            pool, self._pool = pool + self._pool, []
        for worker in pool:
            self._discard(worker)
        self._janitor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - nothing to report to at interpreter shutdown
            pass
