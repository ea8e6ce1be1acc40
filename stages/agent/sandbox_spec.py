"""Pure parts of the python sandbox: code preparation, the bubblewrap command line, output shaping."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

FENCE_LANGS = ("python", "py", "python3", "")
SANDBOX_DIR = "/sandbox"
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/localtime", "/etc/ld.so.cache", "/etc/ld.so.conf")


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
    """Where an interpreter lives: the folders a sandbox must show it (read-only)."""

    executable: str
    prefixes: tuple[str, ...] = field(default_factory=tuple)


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def bwrap_args(paths: InterpreterPaths, privileged: bool, workdir_mb: int) -> list[str]:
    """The bubblewrap command line (before the interpreter's own argv).

    No network (its own empty network namespace), new pid/ipc/uts namespaces, read-only /usr and interpreter
    prefixes, fresh /proc and /dev, size-capped tmpfs for the working dir and /tmp, nothing else of the host.
    `privileged` (the pipeline runs as root): no user namespace, every capability dropped except setuid/setgid,
    which the runner uses once to become an unprivileged uid before the code runs.
    """
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox", "--cap-drop", "ALL"]
    if privileged:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    for name in _ETC_FILES:
        args += ["--ro-bind-try", name, name]
    bound = ["/usr", *[d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]]
    made: set[str] = set()
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
    size = str(workdir_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", SANDBOX_DIR,
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--chdir", SANDBOX_DIR]
    return args


def sandbox_env(home: str) -> dict[str, str]:
    """A minimal environment for the interpreter: one thread per math library, no user site, UTF-8."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
    }


def clip_output(text: str, limit: int) -> tuple[str, bool]:
    """Keep the head (2/3) and tail (1/3) of `text` when it is over `limit` chars; say what was cut."""
    if len(text) <= limit:
        return text, False
    head, tail = (2 * limit) // 3, limit // 3
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters cut] ...\n{text[len(text) - tail:]}", True
