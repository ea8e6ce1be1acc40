"""Why verl dropped a tree: infrastructure (sandbox, search, LLM server, network, Ray) or anything else.

A prompt whose tree raised is removed whole by our agent-loop worker (stages/rl/verl/agent_loop.py) and counted by
the trainer mode as `rollout/trees_dropped`. The worker and the trainer mode are different Ray processes, so the
worker appends one JSON line per failed tree to the file named by the plugin settings (`tree_failures_path`, in
the stage folder, which every node sees): `{"uid", "validate", "fault", "error"}`. The trainer mode reads the lines
added since its previous step (`TreeFailureLog.take`); training trees only. The launcher empties the file before
each attempt.

`fault` is `infra` for the environment's failures: our tools' own infrastructure errors (the sandbox could not
start, the search provider or retrieval server failed after retries), OS / network / timeout errors, verl's
server aborting a request, Ray errors. Everything else is `other` (the model's output met a case our code does
not handle, or a bug of ours): verl.log has each traceback.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path

INFRA, OTHER = "infra", "other"
_INFRA_NAMES = {"SandboxUnavailable", "SearchError", "TimeoutError", "CancelledError", "HTTPError",
                "TransportError", "ConnectError"}


def tree_fault(err: BaseException) -> str:
    """`infra` or `other` for the exception a tree raised (its `raise ... from` causes count too)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        names = {cls.__name__ for cls in type(err).__mro__}
        module = type(err).__module__ or ""
        if isinstance(err, OSError | TimeoutError | ConnectionError) or names & _INFRA_NAMES or \
                module.split(".")[0] in ("ray", "httpx", "httpcore", "aiohttp") or "verl aborted" in str(err):
            return INFRA
        err = err.__cause__
    return OTHER


def record_failure(path: str | None, uid: str, validate: bool, err: BaseException) -> str:
    """Append the failed tree's line (one O_APPEND write, so lines of concurrent workers stay whole); returns
    its fault. Without a path nothing is written."""
    fault = tree_fault(err)
    if path:
        line = json.dumps({"uid": str(uid), "validate": bool(validate), "fault": fault,
                           "error": f"{type(err).__name__}: {err}"[:500]}) + "\n"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode("utf-8", "replace"))
        finally:
            os.close(fd)
    return fault


class TreeFailureLog:
    """The training trees' failures added to the file since the previous `take()`, by fault."""

    def __init__(self, path: str | None) -> None:
        self.path, self.offset = path, 0
        self._lock = threading.Lock()

    def take(self) -> Counter:
        counts: Counter = Counter()
        if not self.path or not os.path.isfile(self.path):
            return counts
        with self._lock, open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
            whole = data[:data.rfind(b"\n") + 1]   # a line being written is read next time
            self.offset += len(whole)
        for line in whole.decode("utf-8", "replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not record.get("validate"):
                counts[record.get("fault", OTHER)] += 1
        return counts
