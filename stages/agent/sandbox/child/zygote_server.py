"""The interpreter side of the python sandbox: a warm parent (the zygote) that forks one child per call.

Stdlib only; started as `python -s -c <this source> <json spec>` by stages/agent/sandbox/zygote_client.py, inside
bubblewrap (mode `bwrap`) or directly on the host (mode `rlimit`).

The zygote, once: imports the preloads (numpy, sympy, common stdlib), freezes the GC (a forked child then does
not write to the page of every inherited object, which made each fork cost ~10 ms more), notes every random
generator the preloads made, and in bwrap mode becomes pid 1 of a pid namespace owned by its own user namespace,
so it may create and leave per-call pid namespaces. Then it serves the control socket: one message per call,
carrying the call's descriptors (code, stdout, stderr, status) and its uid/working dir. It never runs model code.

Each call runs in a fork of that pristine zygote (so no state of an earlier call can be there):
1. bwrap: the child is pid 1 of a new pid namespace and gets new mount, network and IPC namespaces: fresh
   size-capped tmpfs on /sandbox, /tmp and /dev/shm, a new devpts and /proc, loopback only. rlimit: a new
   session, and a network (+IPC) namespace where the kernel allows one.
2. It drops privileges: as root, to the call's own unprivileged uid (which clears every capability); without
   root, into a user namespace of its own (so its process count is its own) with every capability dropped.
   Then no_new_privs, and in the rlimit mode Landlock where the kernel has it.
3. It reseeds the random generators, sets rlimits, reports its isolation facts on the status fd, runs the code.
The zygote kills a call at its deadline (bwrap: its pid namespace dies with its pid 1) and writes the exit
status, CPU time and wall time on the call's status fd.
"""

import builtins
import ctypes
import errno
import gc
import json
import os
import random
import resource
import select
import signal
import socket
import sys
import time
import traceback

if __name__ != "__main__":  # imported as a module; under `python -c` isolation.py's source comes first
    from stages.agent.sandbox.child.isolation import (
        CLONE_NEWPID,
        LIBC,
        MB,
        PR_SET_DUMPABLE,
        SYS_LANDLOCK,
        become,
        call_namespaces,
        checked,
        drop_capabilities,
        landlock_abi,
        landlock_ruleset,
        no_new_privs,
        own_user_namespace,
        prctl,
        try_unshare_network,
    )

STDLIB_PRELOAD = (
    "math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "collections", "heapq",
    "bisect", "random", "re", "string", "json", "datetime", "time", "operator", "numbers", "typing", "copy",
    "array", "struct", "hashlib", "textwrap", "unicodedata", "calendar", "pprint", "dataclasses", "enum",
    "io", "csv", "glob", "pathlib", "shutil", "tempfile", "socket", "subprocess", "signal", "threading",
)


def _vm_bytes():
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _limits(limits, running):
    """rlimits of the call, measured before Landlock hides /proc. The child's CPU time starts at zero; the address
    space is counted beyond what the preloads mapped. The kernel counts processes (threads) per uid and user
    namespace, so `running` = the tasks the host counted under the uid when the call has neither of its own."""
    cpu = limits["cpu_s"] + 1
    nproc = limits["max_processes"] + running
    return {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (_vm_bytes() + limits["memory_mb"] * MB,) * 2,
        resource.RLIMIT_NPROC: (nproc, nproc),
        resource.RLIMIT_FSIZE: (limits["max_file_mb"] * MB,) * 2,
        resource.RLIMIT_NOFILE: (limits["max_open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }


def _set_limits(wanted):
    for kind, (soft, hard) in wanted.items():
        current_hard = resource.getrlimit(kind)[1]
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(kind, (soft, hard))


def _reseed(generators, seed):
    """Forked children share the zygote's generator states: give each call fresh ones (or the configured seed)."""
    for gen in generators:
        kind = type(gen).__name__
        if kind == "Generator":  # numpy.random.Generator: replace its bit generator's state
            bits = gen.bit_generator
            gen.bit_generator.state = (type(bits)() if seed is None else type(bits)(seed)).state
        elif kind == "RandomState":
            gen.seed(None if seed is None else seed % 2**32)
        else:
            gen.seed(seed)


# ---- the model's code --------------------------------------------------------------------------------------------
def _run(code):
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<python>", "exec"), namespace)  # noqa: S102 - this is the sandbox
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - report every failure of the model's code as a traceback
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next if tb is not None else None)
        return 1


def _child(zygote, request, fds):
    """The call: isolate, drop privileges, limit, report its isolation facts, run. Never returns."""
    spec = zygote.spec
    code = os.pread(fds[0], os.fstat(fds[0]).st_size, 0).decode("utf-8", "surrogatepass")
    prctl(PR_SET_DUMPABLE, 1)  # the zygote is not dumpable; a child must own its /proc/self to map its ids
    if spec["mode"] == "bwrap":
        call_namespaces(spec)
    null = os.open("/dev/null", os.O_RDONLY)
    for low, fd in enumerate((null, *fds[1:])):  # stdin, stdout, stderr, status
        os.dup2(fd, low)
    _close_from(4)
    isolate = _isolate_bwrap if spec["mode"] == "bwrap" else _isolate_rlimit
    facts, limits, workdir = isolate(zygote, request)
    facts["preload_failed"] = zygote.failed
    prctl(PR_SET_DUMPABLE, 1)  # again: a uid change resets it
    os.chdir(workdir)
    for name in ("HOME", "TMPDIR"):
        os.environ[name] = workdir
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None  # computed again from TMPDIR
    _reseed(zygote.generators, spec["seed"])
    _set_limits(limits)
    os.write(3, (json.dumps({"facts": facts}) + "\n").encode())
    os.close(3)
    rc = _run(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - e.g. the file-size limit was hit; the traceback says so
            pass
    os._exit(rc & 0xFF)


def _isolate_bwrap(zygote, request):
    """Namespaces are in place (_call_namespaces): drop to the call's uid (root) or own user namespace."""
    uid = request.get("uid")
    limits = _limits(zygote.spec["limits"], 0)  # the call has a uid (root) or a user namespace of its own
    if os.geteuid() == 0 and uid is not None:
        become(uid)
    else:
        own_user_namespace()
        drop_capabilities()
    no_new_privs()
    return {"network": "isolated", "uid_drop": uid is not None, "landlock": 0}, limits, zygote.spec["sandbox_dir"]


def _isolate_rlimit(zygote, request):
    """No bubblewrap: a session and (where allowed) network namespace of its own, the call's uid as root,
    no_new_privs, then Landlock (where the kernel has it) over what bwrap would show."""
    uid, workdir = request.get("uid"), request["workdir"]
    own_uid = os.geteuid() == 0 and uid is not None
    os.setsid()
    network = try_unshare_network()
    os.chdir(workdir)  # before the uid drop: the host's temp folder above it may be closed to the call's uid
    limits = _limits(zygote.spec["limits"], 0 if own_uid or network == "isolated" else request.get("tasks", 0))
    abi = zygote.landlock_abi
    ruleset = landlock_ruleset(abi, zygote.spec["landlock_reads"], [workdir]) if abi else None
    if own_uid:
        become(uid)
    no_new_privs()
    if ruleset is not None:
        checked(LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[2]), ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
        os.close(ruleset)
        network = "tcp-blocked" if network == "open" and abi >= 4 else network
    return {"network": network, "uid_drop": own_uid, "landlock": abi}, limits, workdir


def _close_from(low):
    if LIBC.close_range(ctypes.c_uint(low), ctypes.c_uint(0xFFFFFFFF), ctypes.c_int(0)) != 0:
        os.closerange(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


# ---- the zygote --------------------------------------------------------------------------------------------------
class ZygoteServer:
    def __init__(self, spec):
        self.spec = spec
        self.control = socket.socket(fileno=spec["control_fd"])
        self.failed = []
        for name in STDLIB_PRELOAD + tuple(spec["preload"]):
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - a missing optional module must not stop the sandbox
                self.failed.append(name)
        self.generators = self._generators()
        self.landlock_abi = landlock_abi() if spec["mode"] == "rlimit" and spec["landlock"] else 0
        self.calls = {}  # pid -> [pidfd, deadline, status fd, start]
        self.own_pid_ns = None
        gc.collect()
        gc.freeze()

    @staticmethod
    def _generators():
        kinds = [random.Random]
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            kinds += [numpy.random.RandomState, numpy.random.Generator]
        return [obj for obj in gc.get_objects() if isinstance(obj, tuple(kinds))]

    def serve(self):
        if self.spec["mode"] == "bwrap":
            self._own_pid_namespace()
        prctl(PR_SET_DUMPABLE, 0)  # no call running under our uid (rlimit mode without root) may ptrace us
        self.control.send(json.dumps({"ready": True, "preload_failed": self.failed,
                                      "landlock": self.landlock_abi}).encode())
        poller = select.poll()
        poller.register(self.control.fileno(), select.POLLIN)
        while True:
            now = time.monotonic()
            waits = [c[1] - now for c in self.calls.values() if c[1] is not None]
            timeout = None if not waits else max(0, int(min(waits) * 1000) + 1)
            for fd, _ in poller.poll(timeout):
                if fd == self.control.fileno():
                    if not self._accept(poller):
                        return self._shutdown()
                else:
                    self._reap(fd, poller)
            self._expire()

    def _own_pid_namespace(self):
        """Become pid 1 of a pid namespace owned by our user namespace: bubblewrap's own may belong to the host's,
        where we could not switch back after creating a call's namespace."""
        checked(LIBC.unshare(CLONE_NEWPID), "unshare pid namespace")
        pid = os.fork()
        if pid:
            self.control.close()
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)

    def _accept(self, poller):
        try:
            message, fds, _, _ = socket.recv_fds(self.control, 65536, 8)
        except OSError as err:
            return err.errno in (errno.EINTR, errno.EAGAIN)
        if not message:
            return False
        request = json.loads(message)
        try:
            pid = self._fork(request, fds)
        except OSError as err:  # e.g. EAGAIN: the machine is out of processes
            os.write(fds[3], (json.dumps({"exit": None, "error": str(err)}) + "\n").encode())
            pid = None
        if pid is None:
            for fd in fds:
                os.close(fd)
            return True
        for fd in fds[:3]:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
        self.calls[pid] = [pidfd, time.monotonic() + self.spec["timeout_s"], fds[3], time.monotonic()]
        return True

    def _fork(self, request, fds):
        bwrap = self.spec["mode"] == "bwrap"
        if bwrap:  # the next child is pid 1 of a new pid namespace; undone right after the fork
            checked(LIBC.unshare(CLONE_NEWPID), "unshare pid namespace")
        try:
            pid = os.fork()
        except OSError:
            if bwrap:
                checked(LIBC.setns(self.own_pid_ns, CLONE_NEWPID), "setns")
            raise
        if pid == 0:
            try:
                _child(self, request, fds)
            except BaseException as err:  # noqa: BLE001 - the isolation failed: say so, run nothing
                note = f"The python sandbox could not isolate this call: {err!r}\n".encode(errors="replace")
                try:
                    os.write(fds[2], note)
                except OSError:
                    os.write(2, note)  # already moved to 2
            os._exit(125)
        if bwrap:
            checked(LIBC.setns(self.own_pid_ns, CLONE_NEWPID), "setns")
        return pid

    def _reap(self, pidfd, poller):
        pid = next(p for p, c in self.calls.items() if c[0] == pidfd)
        _, deadline, status_fd, start = self.calls.pop(pid)
        poller.unregister(pidfd)
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        exit_facts = {"exit": os.waitstatus_to_exitcode(status), "timed_out": deadline is None,
                      "cpu_s": round(usage.ru_utime + usage.ru_stime, 4), "wall_s": round(time.monotonic() - start, 4)}
        try:
            os.write(status_fd, (json.dumps(exit_facts) + "\n").encode())
        except OSError:
            pass  # the host stopped waiting
        os.close(status_fd)

    def _kill(self, pid):
        """bwrap: the call's pid 1, whose pid namespace dies with it; rlimit: the call's process group (the host
        then sweeps the call's uid)."""
        try:
            os.kill(pid, signal.SIGKILL) if self.spec["mode"] == "bwrap" else os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except OSError as err:
            print(f"sandbox: could not end call {pid}: {err}", file=sys.stderr, flush=True)

    def _expire(self):
        now = time.monotonic()
        for pid, call in self.calls.items():
            if call[1] is not None and call[1] <= now:
                call[1] = None  # timed out: reaped as soon as it is gone
                self._kill(pid)

    def _shutdown(self):
        for pid in self.calls:
            self._kill(pid)
        os._exit(0)


def main():
    sys.path[:] = [p for p in sys.path if p]  # not the working dir: a call's files must not shadow modules
    ZygoteServer(json.loads(sys.argv[1])).serve()


if __name__ == "__main__":
    main()
