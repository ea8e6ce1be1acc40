"""Pure parts of the python sandbox: code preparation, the bubblewrap command line, the environment, output shaping."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

FENCE_LANGS = ("python", "py", "python3", "")
SANDBOX_DIR = "/sandbox"
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/localtime", "/etc/ld.so.cache", "/etc/ld.so.conf")
_DEV_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
CALL_MOUNTS = (SANDBOX_DIR, "/tmp", "/dev/shm")  # a fresh tmpfs per call (bwrap mode)


def strip_fences(code: str) -> str:
    """Remove a surrounding markdown code fence (```python … ```), which models often write inside <python>."""
    text = code.strip()
    if not text.startswith("```"):
        return code
    first, _, rest = text.partition("\n")
    if first[3:].strip().lower() not in FENCE_LANGS:
        return code
    body = rest.rstrip()
    return body[:-3].rstrip() if body.endswith("```") else body


def prepare_code(code: str) -> str:
    """Strip fences; if the last top-level statement is a bare expression (not a print call), print it.

    `x = 2\\nx * 3` -> `x = 2\\nprint(x * 3)` (as the reference does). Code that does not parse is returned
    unchanged so the interpreter reports the SyntaxError itself.
    """
    code = strip_fences(code)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    value = last.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return code
    lines = code.splitlines(keepends=True)
    head = "".join(lines[: last.lineno - 1]) + lines[last.lineno - 1][: last.col_offset]
    expr = ast.get_source_segment(code, value)
    if expr is None:
        return code
    return f"{head}print({expr})\n"


@dataclass(frozen=True)
class InterpreterPaths:
    """Where an interpreter lives (the folders a sandbox must show it, read-only) and what it runs."""

    executable: str
    prefixes: tuple[str, ...] = field(default_factory=tuple)
    version: str = ""
    packages: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (distribution, version) of preloads


def _covered(path: str, roots: list[str] | tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def call_rebinds(paths: InterpreterPaths) -> list[str]:
    """Interpreter folders that lie under a per-call mount (e.g. a venv under /tmp): each call mounts a fresh
    tmpfs there, so the call binds them again on top of it."""
    return [p for p in paths.prefixes if _covered(p, CALL_MOUNTS)]


def bwrap_args(paths: InterpreterPaths, privileged: bool, workdir_mb: int, binary: str = "bwrap") -> list[str]:
    """The bubblewrap command line of the warm parent (before the interpreter's own argv).

    No network (its own empty network namespace), new pid/ipc/uts namespaces, read-only /usr and interpreter
    prefixes, fresh /proc and /dev, size-capped tmpfs for the working dir and /tmp, nothing else of the host.
    The tmpfs mounts come first and the read-only binds after them, so an interpreter under /tmp (a repo cloned
    there) stays visible. Capabilities: only what the parent needs to give each call namespaces of its own
    (CAP_SYS_ADMIN; CAP_NET_ADMIN to bring up each call's loopback) and, as root, to switch each call to an
    unprivileged uid (CAP_SETUID/SETGID); every call
    drops all of them before the model's code runs (CAP_KILL lets the parent end a call that runs as another uid).
    Without root, a user namespace holds them.
    """
    args = [binary, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox", "--cap-drop", "ALL",
            "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"]
    if privileged:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
    else:
        args += ["--unshare-user"]
    size = str(workdir_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", SANDBOX_DIR,
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    for name in _ETC_FILES:
        args += ["--ro-bind-try", name, name]
    bound = ["/usr", *[d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]]
    made: set[str] = {"/tmp", SANDBOX_DIR, "/dev", "/proc"}
    for prefix in sorted(set(paths.prefixes), key=len):
        if _covered(prefix, bound):
            continue
        parents = list(Path(prefix).parents)[::-1][1:]  # skip "/"
        for parent in map(str, parents):
            if parent not in made and not _covered(parent, bound):
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", prefix, prefix]
        bound.append(prefix)
    return args + ["--chdir", SANDBOX_DIR]


def landlock_reads(paths: InterpreterPaths) -> list[str]:
    """What a call may read (and execute) under Landlock in the rlimit mode: the same view bwrap gives."""
    system = ["/usr", *[d for d in _SYSTEM_DIRS if os.path.isdir(d)], *_ETC_FILES, *_DEV_FILES]
    return [p for p in dict.fromkeys([*system, *paths.prefixes]) if os.path.exists(p)]


def sandbox_env(home: str, hash_seed: int | None = None) -> dict[str, str]:
    """A minimal environment for the interpreter: one thread per math library, no user site, UTF-8.

    `hash_seed` fixes str hashing (set iteration order), so a seeded configuration prints the same output for
    the same code on every run; None keeps Python's per-process random hash seed.
    """
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
        "PYTHONHASHSEED": "random" if hash_seed is None else str(hash_seed % 4294967296),
    }


def clip_output(text: str, limit: int) -> tuple[str, bool]:
    """Keep the head (2/3) and tail (1/3) of `text` when it is over `limit` chars; say what was cut."""
    if len(text) <= limit:
        return text, False
    head, tail = (2 * limit) // 3, limit // 3
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters cut] ...\n{text[len(text) - tail:]}", True
