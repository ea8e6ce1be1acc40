"""Run model-written python in an isolated, resource-limited process: `PythonSandbox(cfg).run(code) -> ExecResult`.

Two isolation levels (`agent.python.sandbox`); docs/agent.md states what each contains and what it does not:
- `bwrap` (and `auto`, the default): bubblewrap. Every call gets its own pid, mount, network and IPC
  namespaces, fresh tmpfs working dir and /tmp, only /usr and the interpreter visible (read-only), an
  unprivileged uid (or, without root, a user namespace of its own) with no capabilities. When bubblewrap cannot
  run, `auto` stops with the reason and the fix; it never falls back on its own.
- `rlimit`: an explicit opt-in for machines without namespaces: a private working dir, HOME and TMPDIR,
  no_new_privs, Landlock where the kernel has it, and, as root, a uid of the call's own whose leftovers
  (processes, files in the shared temp folders, SysV IPC) are removed after the call.
Both add rlimits (CPU, address space, processes, file size, open files), a wall-clock timeout and capped output.

Speed: one warm parent per sandbox (zygote_client.py, serving child/zygote_server.py) has numpy/sympy imported
and forks each call from that pristine state, so a call costs a fork (a few ms) instead of an interpreter start
plus imports, and concurrent calls do not wait for each other.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Self

from stages.agent.sandbox.host import (
    SandboxUnavailable,
    interpreter_paths,
    is_root,
    kill_uid,
    read_capped,
    remove_files_of,
    tasks_of,
    uid_allocator,
)
from stages.agent.sandbox.spec import (
    SANDBOX_DIR,
    InterpreterPaths,
    prepare_code,
    sandbox_env,
)
from stages.agent.sandbox.zygote_client import CallOutcome, WarmParent, zygote_argv
from stages.core.config.agent import PythonToolSection
from stages.core.log import get_logger

log = get_logger(__name__)
_LIVE: weakref.WeakSet = weakref.WeakSet()
TASK_COUNT_TTL_S = 0.5
SETUP_FAILED = 125  # the call's child could not isolate itself and ran nothing (child/zygote_server.py)
HOW_TO_FIX = (
    "Fix it: install bubblewrap (`apt-get install -y bubblewrap`; scripts/setup.sh does this when run as root) "
    "and, when the pipeline does not run as root, allow unprivileged user namespaces (Debian/older kernels: "
    "`sysctl -w kernel.unprivileged_userns_clone=1`; Ubuntu 24.04+: `sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile for bwrap; Docker: run with "
    "`--security-opt seccomp=unconfined --security-opt apparmor=unconfined` or `--privileged`). "
    "Or accept the weaker isolation explicitly with `agent.python.sandbox: rlimit` "
    "(docs/agent.md lists what it does not contain).")


@atexit.register
def _close_live_sandboxes() -> None:
    """Stop the warm parents of sandboxes nobody closed before exit."""
    for box in list(_LIVE):
        try:
            box.close()
        except Exception as err:  # noqa: BLE001 - keep closing the others
            log.warning("python sandbox: cleanup at exit failed: %s", err)


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one call. `status`: ok | error | timeout | cpu_limit | killed | refused | start_failed.

    `infra`: the sandbox failed, not the code: it could not start (`start_failed`), or it never reported the
    call's end (the warm parent died under it, or hung past the call's timeout plus a grace: `killed` / `timeout`
    without an exit record). A timeout, CPU or memory limit the code itself ran into, its exceptions and its own
    signals have an exit record and are the code's (`infra` false)."""

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    duration_s: float
    meta: dict = field(default_factory=dict)
    infra: bool = False

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


def _settings(cfg: PythonToolSection) -> dict:
    return {"preload": list(cfg.preload), "timeout_s": cfg.timeout_s, "seed": cfg.seed, "workdir_mb": cfg.workdir_mb,
            "limits": {"cpu_s": cfg.cpu_s, "memory_mb": cfg.memory_mb, "max_processes": cfg.max_processes,
                       "max_file_mb": cfg.max_file_mb, "max_open_files": cfg.max_open_files}}


@lru_cache(maxsize=8)
def probe_bwrap(paths: InterpreterPaths, workdir_mb: int, privileged: bool) -> str | None:
    """None when bubblewrap runs a call here (warm parent, per-call namespaces, uid drop), else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed"
    cfg = PythonToolSection(preload=[], workdir_mb=workdir_mb, timeout_s=30.0)
    parent = WarmParent(zygote_argv("bwrap", _settings(cfg), paths, privileged), sandbox_env(SANDBOX_DIR), None,
                        60.0, 30.0)
    try:
        uids = uid_allocator(cfg.uid_base) if privileged else None
        uid = uids.acquire() if uids else None
        try:
            outcome = parent.call(b"print('probe', 6 * 7)", {"uid": uid})
        finally:
            if uids and uid is not None:
                uids.release(uid)
        out = os.pread(outcome.stdout_fd, 4096, 0).decode(errors="replace") if outcome.stdout_fd >= 0 else ""
        err = os.pread(outcome.stderr_fd, 4096, 0).decode(errors="replace") if outcome.stderr_fd >= 0 else ""
        outcome.close()
        if outcome.exit is not None and outcome.exit.get("exit") == 0 and out.strip() == "probe 42":
            return None
        detail = outcome.lost or err.strip() or parent.startup_error() or f"exit record {outcome.exit}"
        return f"bwrap cannot run a call here: {detail.strip()[-800:]}"
    finally:
        parent.close()


def resolve_mode(cfg: PythonToolSection, paths: InterpreterPaths | None = None) -> tuple[str, str]:
    """(mode, reason): the isolation level `cfg.sandbox` gets here. Raises SandboxUnavailable (with the fix)
    when bubblewrap is wanted (`auto` or `bwrap`) and cannot run: there is no silent fallback."""
    if cfg.sandbox == "rlimit":
        return "rlimit", "configured (agent.python.sandbox: rlimit)"
    paths = paths or interpreter_paths(cfg.python_executable or sys.executable, tuple(cfg.preload))
    problem = probe_bwrap(paths, cfg.workdir_mb, is_root())
    if problem is None:
        return "bwrap", "bubblewrap works"
    raise SandboxUnavailable(f"agent.python.sandbox={cfg.sandbox} needs bubblewrap, and it cannot run here: "
                             f"{problem}. {HOW_TO_FIX}")


class PythonSandbox:
    """Thread-safe runner of untrusted python; `run(code) -> ExecResult`. Close it (or use `with`)."""

    def __init__(self, cfg: PythonToolSection, host_tmp: str | os.PathLike | None = None) -> None:
        """`host_tmp`: where the rlimit mode's per-call working dirs go; None = the system temp dir."""
        self.cfg = cfg
        self.host_tmp = str(host_tmp) if host_tmp is not None else None
        self.executable = cfg.python_executable or sys.executable
        self.paths = interpreter_paths(self.executable, tuple(cfg.preload))
        self.mode, self.mode_reason = resolve_mode(cfg, self.paths)
        self.privileged = is_root()
        self._uids = uid_allocator(cfg.uid_base) if self.privileged else None
        self._tasks_lock, self._tasks_count, self._tasks_at = threading.Lock(), 0, -1e9
        if self.mode == "rlimit":
            log.warning("python sandbox: rlimit mode (%s); it contains less than bubblewrap (docs/agent.md)",
                        self.mode_reason)
        home = SANDBOX_DIR if self.mode == "bwrap" else (self.host_tmp or tempfile.gettempdir())
        self._parent = WarmParent(zygote_argv(self.mode, _settings(cfg), self.paths, self.privileged),
                                  sandbox_env(home, cfg.seed), None if self.mode == "bwrap" else home,
                                  cfg.startup_timeout_s, cfg.timeout_s)
        _LIVE.add(self)

    def identity(self) -> dict:
        """Everything about this sandbox that can change what a call prints (for the tool cache's key)."""
        return {"mode": self.mode, "privileged": self.privileged, "interpreter": self.paths.executable,
                "prefixes": self.paths.prefixes, "version": self.paths.version, "packages": self.paths.packages,
                "limits": self.cfg.model_dump(exclude={"sandbox", "startup_timeout_s", "uid_base"})}

    def wait_warm(self, timeout_s: float = 60.0) -> bool:
        """Block until the warm parent has finished its preloads."""
        return self._parent.wait_ready(timeout_s)

    # ---- one call ------------------------------------------------------------------------------------------
    def run(self, code: str) -> ExecResult:
        """Run `code` (fences stripped, last bare expression printed) in a fresh fork of the warm parent."""
        if len(code) > self.cfg.max_code_chars:
            return ExecResult("refused", "", f"Code is {len(code)} characters; the limit is "
                              f"{self.cfg.max_code_chars}.", None, 0.0, self._meta({}))
        source = prepare_code(code).encode("utf-8", "surrogatepass")
        uid = self._uids.acquire() if self._uids else None
        workdir = self._workdir(uid) if self.mode == "rlimit" else None
        tasks = self._tasks() if uid is None and self.mode == "rlimit" else 0  # a call without a uid of its own
        request = {"uid": uid, "workdir": workdir, "tasks": tasks}
        outcome = CallOutcome()
        try:
            outcome = self._parent.call(source, request)
            return self._result(outcome, uid)
        finally:
            outcome.close()
            self._after_call(uid, workdir)

    def _tasks(self) -> int:
        """rlimit mode without root: a call that gets no user namespace shares this user's process count, so
        max_processes is added to the tasks the user already runs (the pipeline's threads included); counted at
        most every TASK_COUNT_TTL_S."""
        now = time.monotonic()
        with self._tasks_lock:
            if now - self._tasks_at > TASK_COUNT_TTL_S:
                self._tasks_count, self._tasks_at = tasks_of(os.getuid()), now
            return self._tasks_count

    def _workdir(self, uid: int | None) -> str:
        folder = tempfile.mkdtemp(prefix="arpo-py-", dir=self.host_tmp)
        if uid is not None:
            os.chown(folder, uid, uid)
        return folder

    def _after_call(self, uid: int | None, workdir: str | None) -> None:
        if self.mode == "rlimit" and uid is not None:  # bwrap: the call's namespaces took everything with them
            kill_uid(uid)
            remove_files_of(uid)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None and self._uids is not None:
            self._uids.release(uid)

    def _result(self, outcome: CallOutcome, uid: int | None) -> ExecResult:
        cfg = self.cfg
        stdout, out_cut, size = read_capped(outcome.stdout_fd, cfg.max_output_chars) if outcome.stdout_fd >= 0 \
            else ("", False, 0)
        stderr, err_cut, _ = read_capped(outcome.stderr_fd, cfg.max_output_chars) if outcome.stderr_fd >= 0 \
            else ("", False, 0)
        record = outcome.exit or {}
        rc, wall = record.get("exit"), float(record.get("wall_s", 0.0))
        infra = outcome.exit is None  # no exit record: the sandbox, not the code, ended the call
        if outcome.exit is None:
            status = "timeout" if outcome.lost.startswith("no answer") else "killed"
            status = "start_failed" if "failed to start" in outcome.lost else status
            stderr = "\n".join(p for p in (stderr, outcome.lost) if p)
        elif "error" in record or (rc == SETUP_FAILED and not outcome.facts):
            status, infra = "start_failed", True
            stderr = "\n".join(p for p in (stderr, record.get("error", "")) if p)
        elif record.get("timed_out"):
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif rc is not None and rc < 0:
            hit_cpu = -rc == signal.SIGXCPU or (-rc == signal.SIGKILL and record.get("cpu_s", 0) >= cfg.cpu_s)
            status = "cpu_limit" if hit_cpu else "killed"
        else:
            status = "error"
        meta = self._meta({**outcome.facts, "uid": uid, "truncated": out_cut or err_cut,
                           "output_limit_hit": size >= (cfg.max_file_mb << 20) - 65536})
        return ExecResult(status, stdout, stderr, rc, wall, meta, infra)

    def _meta(self, extra: dict) -> dict:
        return {"sandbox": self.mode, "sandbox_reason": self.mode_reason, "timeout_s": self.cfg.timeout_s,
                "cpu_s": self.cfg.cpu_s, **extra}

    # ---- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._parent.close()
        _LIVE.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - nothing to report to at interpreter shutdown
            pass
