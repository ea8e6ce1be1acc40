"""Run a stage entry point under another Python interpreter, as a subprocess on JSON inputs.

Conflicting stacks never share a venv: vLLM pins a newer transformers than LLaMA-Factory allows, so GPU rollouts and
serving can run from a vLLM environment while SFT runs from the main one. The call crosses as JSON: pydantic
arguments (config sections, refs) are dumped, and rebuilt in the child from the function's type hints; the return
value comes back the same way, and so does the class of error it raised (a `DeterministicError` stays one, so the
task layer does not retry it). Its log records and progress messages cross through a JSONL file
(stages.core.reporter), its other output through a pipe (stages.core.streams), so a stage under another interpreter
shows in the UI as one in this process does. The child needs this project on its path (we set PYTHONPATH) and
pydantic + PyYAML + rich.

    python -m stages.core.isolate <request.json> <response.json>
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import typing
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from stages.core.env import PROJECT_ROOT
from stages.core.errors import BadInputError, DeterministicError, InputError, MissingInputError
from stages.core.fingerprint import _plain
from stages.core.log import get_logger
from stages.core.reporter import EVENTS_ENV, Relay, install_child_sink
from stages.core.streams import LineForwarder


class IsolatedStageError(RuntimeError):
    pass


class IsolatedDeterministicError(IsolatedStageError, DeterministicError):
    """The child raised a `DeterministicError` (a config error, a stop-on alarm): not worth a retry either."""


def resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"target {target!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def call_in_interpreter(python: str, target: str, kwargs: dict[str, Any], timeout: float | None = None) -> Any:
    """Call `target(**kwargs)` under `python`; return its result rebuilt as the annotated return type.

    The child's log records and reporter messages come back through a JSONL file (levels and progress intact);
    anything else it prints (warnings, a traceback, C-level output) is forwarded line by line."""
    fn = resolve(target)
    with tempfile.TemporaryDirectory(prefix="arpo-isolate-") as tmp:
        request, response, events = Path(tmp) / "request.json", Path(tmp) / "response.json", Path(tmp) / "events.jsonl"
        request.write_text(json.dumps({"target": target, "kwargs": _plain(kwargs)}))
        env = {**os.environ, EVENTS_ENV: str(events),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
               "ARPO_PARENT_PYTHON": sys.executable}  # e.g. the verl stage's token-id parity check
        module, _, name = target.partition(":")
        output = LineForwarder(get_logger(module), f"{name} output")
        with Relay(events):
            code = _run(python, [str(request), str(response)], env, output, timeout)
        output.close()
        payload = json.loads(response.read_text()) if response.is_file() else {}
    error = payload.get("error") or {}
    if error.get("input"):  # the user's config or data: the message is the whole story, raised as such
        raise (MissingInputError if error.get("missing") else BadInputError)(error["message"])
    if code != 0 or "result" not in payload:
        cls = IsolatedDeterministicError if error.get("deterministic") else IsolatedStageError
        what = f"{error.get('type')}: {error.get('message')}" if error else "no result"
        raise cls(f"{target} under {python} exited with code {code} ({what}); last lines of its output:\n"
                  + output.last_lines(15))
    hint = typing.get_type_hints(fn).get("return", Any)
    return TypeAdapter(hint).validate_python(payload["result"])


def _run(python: str, args: list[str], env: dict[str, str], output: LineForwarder, timeout: float | None) -> int:
    proc = subprocess.Popen([python, "-m", "stages.core.isolate", *args], env=env, cwd=os.getcwd(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
    timer = threading.Timer(timeout, proc.kill) if timeout else None
    if timer:
        timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.feed(line)
        return proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if timer:
            timer.cancel()


def _run_child(request_path: str, response_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    fn = resolve(request["target"])
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    kwargs = {}
    for name, value in request["kwargs"].items():
        if name not in params:
            raise TypeError(f"{request['target']} has no parameter {name!r}")
        kwargs[name] = TypeAdapter(hints.get(name, Any)).validate_python(value)
    try:
        result = fn(**kwargs)
    except Exception as err:
        Path(response_path).write_text(json.dumps({"error": {
            "type": type(err).__name__, "message": str(err)[:4000],
            "deterministic": isinstance(err, DeterministicError), "input": isinstance(err, InputError),
            "missing": isinstance(err, FileNotFoundError)}}))
        if isinstance(err, InputError):  # the parent re-raises the message: no traceback
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    Path(response_path).write_text(json.dumps({"result": _plain(result)}))


if __name__ == "__main__":
    from stages.core.env import configure_environment

    configure_environment()
    if os.environ.get(EVENTS_ENV):
        install_child_sink(os.environ[EVENTS_ENV])
    _run_child(sys.argv[1], sys.argv[2])
