"""The interpreter side of the python sandbox. Stdlib only; run as `python -I -c <this source> <json>`.

Order of events (the parent is stages/agent/sandbox.py):
1. import the preload modules (numpy, sympy, common stdlib) while the interpreter waits in the pool;
2. write `ready` on the status fd, then block reading the code from stdin (the parent closes it);
3. isolate: in the fallback, a new network namespace when the kernel allows it; when running as root,
   drop to the unprivileged uid the parent picked (so RLIMIT_NPROC applies and files are not readable);
4. set rlimits relative to what the preloads used (CPU, address space, processes, file size, open files);
5. report the isolation facts on the status fd and close it, empty stdout/stderr, run the code with the
   last bare expression already turned into a print by the parent.
"""

import builtins
import ctypes
import json
import os
import resource
import sys
import traceback

STDLIB_PRELOAD = (
    "math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "collections", "heapq",
    "bisect", "random", "re", "string", "json", "datetime", "time", "operator", "numbers", "typing", "copy",
    "array", "struct", "hashlib", "textwrap", "unicodedata", "calendar", "pprint", "dataclasses", "enum",
    "io", "csv", "glob", "pathlib", "shutil", "tempfile", "socket", "subprocess", "signal", "threading",
)
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MB = 1 << 20


def _unshare_network() -> str:
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return "isolated" if libc.unshare(flags) == 0 else "open"
    except (OSError, AttributeError):
        return "open"


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _own_process_count(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as handle:
                    for line in handle:
                        if line.startswith("Uid:"):
                            count += int(line.split()[1]) == uid
                            break
            except OSError:
                continue
    return count


def _vm_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _set_limits(cfg: dict, per_sandbox_nproc: bool) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(usage.ru_utime + usage.ru_stime) + 1 + cfg["cpu_s"]
    nproc = cfg["max_processes"] + (0 if per_sandbox_nproc else _own_process_count(os.getuid()))
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (_vm_bytes() + cfg["memory_mb"] * MB,) * 2,
        resource.RLIMIT_NPROC: (nproc, nproc),
        resource.RLIMIT_FSIZE: (cfg["max_file_mb"] * MB,) * 2,
        resource.RLIMIT_NOFILE: (cfg["max_open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for kind, (soft, hard) in limits.items():
        current_hard = resource.getrlimit(kind)[1]
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(kind, (soft, hard))


def _run(code: str) -> int:
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


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status = os.fdopen(cfg["status_fd"], "w", buffering=1)
    failed = []
    for name in STDLIB_PRELOAD + tuple(cfg["preload"]):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing optional module must not kill the interpreter
            failed.append(name)
    status.write("ready\n")
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    facts = {"network": cfg["network"], "uid_drop": False, "preload_failed": failed}
    if cfg["network"] == "unshare":
        facts["network"] = _unshare_network()
    per_sandbox = cfg["per_sandbox_nproc"] or (facts["network"] == "isolated" and os.geteuid() != 0)
    if os.geteuid() == 0 and cfg.get("uid") is not None:
        _drop_privileges(cfg["uid"])
        facts["uid_drop"] = True
        per_sandbox = True
    _set_limits(cfg, per_sandbox)
    status.write(json.dumps(facts) + "\n")
    status.close()
    for fd in (1, 2):
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            pass
    rc = _run(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - e.g. the file-size limit was hit; the traceback says so
            pass
    os._exit(rc & 0xFF)


if __name__ == "__main__":
    main()
