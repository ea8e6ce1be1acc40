"""The interpreter side of the python sandbox: a warm parent (the zygote) that forks one child per call.

Stdlib only; started as `python -s -c <this source> <json spec>` by stages/agent/sandbox_zygote.py, inside
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
import stat
import struct
import sys
import time
import traceback

STDLIB_PRELOAD = (
    "math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "collections", "heapq",
    "bisect", "random", "re", "string", "json", "datetime", "time", "operator", "numbers", "typing", "copy",
    "array", "struct", "hashlib", "textwrap", "unicodedata", "calendar", "pprint", "dataclasses", "enum",
    "io", "csv", "glob", "pathlib", "shutil", "tempfile", "socket", "subprocess", "signal", "threading",
)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self: the same number on every arch
LL_FS_FILE = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # execute, write, read, truncate, ioctl_dev: rights a file rule may hold
LL_FS_READ = 1 | 4 | 8  # execute, read file, read dir
MB = 1 << 20
LIBC = ctypes.CDLL(None, use_errno=True)


def _sys(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


# ---- isolation steps of one call ------------------------------------------------------------------------------
def _mount(source, target, fstype, flags, data=None):
    enc = (lambda v: v.encode() if isinstance(v, str) else v)
    _sys(LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _call_namespaces(spec):
    """bwrap mode, in the child (already pid 1 of its own pid namespace): private mounts, network, IPC."""
    _sys(LIBC.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # interpreter folders under a per-call mount (a venv under /tmp): held open (in this mount namespace: a bind
    # source must be in it) before the tmpfs covers them, bound again on top of it
    rebinds = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in spec["rebind"]]
    size = f"size={spec['workdir_mb'] * MB},mode=1777"
    for target in spec["call_mounts"]:
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, size)
    for path, fd in rebinds:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _loopback_up()


def _loopback_up():
    """Bring `lo` up in the call's network namespace (code may talk to itself, never to the host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", _ioctl(sock.fileno(), 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        _ioctl(sock.fileno(), 0x8914, struct.pack("16sh22x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP


def _ioctl(fd, request, arg):
    buf = ctypes.create_string_buffer(arg, len(arg))
    _sys(LIBC.ioctl(fd, ctypes.c_ulong(request), buf), "ioctl")
    return buf.raw


def _try_unshare_network():
    """rlimit mode: a network and IPC namespace of the call's own where the kernel allows it (without root, in a
    user namespace of its own, which also gives the call its own process count)."""
    if os.geteuid() == 0:
        return "isolated" if LIBC.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0 else "open"
    uid, gid = os.getuid(), os.getgid()
    if LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) != 0:
        return "open"
    _map_ids(uid, gid)
    return "isolated"


def _own_user_namespace():
    """Without root: a user namespace of the call's own. The kernel counts processes per user namespace and uid
    (checked up the chain against each creator's limit), so max_processes becomes this call's alone, as a fresh
    uid gives it as root. Its capabilities there are dropped right after."""
    uid, gid = os.getuid(), os.getgid()
    _sys(LIBC.unshare(CLONE_NEWUSER), "unshare user namespace")
    _map_ids(uid, gid)


def _map_ids(uid, gid):
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)


def _drop_capabilities():
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _sys(LIBC.capset(header, data), "capset")


def _become(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # from root to non-root: every capability is cleared


def _landlock_abi():
    return max(0, LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def _landlock_ruleset(abi, reads, writes):
    """A Landlock ruleset (fd) for the rlimit mode: read+execute `reads`, everything in `writes`, no other file
    access; no TCP bind/connect (ABI >= 4); no signals or abstract unix sockets outside the call (ABI >= 6)."""
    fs_all = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = struct.pack("QQQ", fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _sys(LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[0]), buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
                   "landlock_create_ruleset")
    for path, access in [(p, LL_FS_READ) for p in reads] + [(p, fs_all) for p in writes]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            allowed = access & fs_all & (-1 if stat.S_ISDIR(os.fstat(fd).st_mode) else LL_FS_FILE)
            rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
            _sys(LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[1]), ruleset, ctypes.c_int(1), rule, ctypes.c_uint32(0)),
                 f"landlock_add_rule {path}")
        finally:
            os.close(fd)
    return ruleset


def _no_new_privs():
    _sys(LIBC.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
         "no_new_privs")


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
    """The call: isolate, drop privileges, limit, report, run. Never returns."""
    spec = zygote.spec
    code_fd, out_fd, err_fd, status_fd = fds
    code = os.pread(code_fd, os.fstat(code_fd).st_size, 0).decode("utf-8", "surrogatepass")
    facts = {"preload_failed": zygote.failed, "uid_drop": False}
    uid, root = request.get("uid"), os.geteuid() == 0
    ruleset = None
    LIBC.prctl(PR_SET_DUMPABLE, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if spec["mode"] == "bwrap":  # (the zygote is not dumpable; a child must own its /proc/self to map its ids)
        _call_namespaces(spec)
    null = os.open("/dev/null", os.O_RDONLY)
    for low, fd in enumerate((null, out_fd, err_fd, status_fd)):
        os.dup2(fd, low)
    _close_from(4)
    if spec["mode"] == "bwrap":
        facts["network"] = "isolated"
        workdir = spec["sandbox_dir"]
        limits = _limits(spec["limits"], 0)  # a uid (root) or a user namespace (below) of its own
    else:
        os.setsid()
        facts["network"] = _try_unshare_network()
        workdir = request["workdir"]
        os.chdir(workdir)  # before the uid drop: the host's temp folder above it may be closed to the call's uid
        own_count = (root and uid is not None) or facts["network"] == "isolated"  # own uid or user namespace
        limits = _limits(spec["limits"], 0 if own_count else request.get("tasks", 0))
        if zygote.landlock_abi:
            ruleset = _landlock_ruleset(zygote.landlock_abi, spec["landlock_reads"], [workdir])
    if root and uid is not None:
        _become(uid)
        facts["uid_drop"] = True
    elif spec["mode"] == "bwrap":
        _own_user_namespace()
        _drop_capabilities()
    _no_new_privs()
    if ruleset is not None:
        _sys(LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[2]), ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
        os.close(ruleset)
        facts["network"] = "tcp-blocked" if facts["network"] == "open" and zygote.landlock_abi >= 4 else facts["network"]
    facts["landlock"] = zygote.landlock_abi if ruleset is not None else 0
    LIBC.prctl(PR_SET_DUMPABLE, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if spec["mode"] == "bwrap":
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


def _close_from(low):
    if LIBC.close_range(ctypes.c_uint(low), ctypes.c_uint(0xFFFFFFFF), ctypes.c_int(0)) != 0:
        os.closerange(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


# ---- the zygote --------------------------------------------------------------------------------------------------
class Zygote:
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
        self.landlock_abi = _landlock_abi() if spec["mode"] == "rlimit" and spec["landlock"] else 0
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
        _sys(LIBC.unshare(CLONE_NEWPID), "unshare pid namespace")
        pid = os.fork()
        if pid:
            self.control.close()
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
        LIBC.prctl(PR_SET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))

    def _accept(self, poller):
        try:
            message, fds, _, _ = socket.recv_fds(self.control, 65536, 8)
        except OSError as err:
            if err.errno in (errno.EINTR, errno.EAGAIN):
                return True
            return False
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
            _sys(LIBC.unshare(CLONE_NEWPID), "unshare pid namespace")
        try:
            pid = os.fork()
        except OSError:
            if bwrap:
                _sys(LIBC.setns(self.own_pid_ns, CLONE_NEWPID), "setns")
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
            _sys(LIBC.setns(self.own_pid_ns, CLONE_NEWPID), "setns")
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
    Zygote(json.loads(sys.argv[1])).serve()


if __name__ == "__main__":
    main()
