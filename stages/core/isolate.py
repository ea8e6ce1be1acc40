"""Run a stage entry point under another Python interpreter, as a subprocess on JSON inputs.

Conflicting stacks never share a venv: vLLM pins a newer transformers than LLaMA-Factory allows, so GPU rollouts and
serving can run from a vLLM environment while SFT runs from the main one. The call crosses as JSON: pydantic
arguments (config sections, refs) are dumped, and rebuilt in the child from the function's type hints; the return
value comes back the same way. The child needs this project on its path (we set PYTHONPATH) and pydantic + PyYAML.

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
import typing
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from stages.core.env import PROJECT_ROOT
from stages.core.errors import BadInputError, InputError, MissingInputError
from stages.core.fingerprint import _plain


class IsolatedStageError(RuntimeError):
    pass


def resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"target {target!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def call_in_interpreter(python: str, target: str, kwargs: dict[str, Any], timeout: float | None = None) -> Any:
    """Call `target(**kwargs)` under `python`; return its result rebuilt as the annotated return type."""
    fn = resolve(target)
    with tempfile.TemporaryDirectory(prefix="arpo-isolate-") as tmp:
        request, response = Path(tmp) / "request.json", Path(tmp) / "response.json"
        request.write_text(json.dumps({"target": target, "kwargs": _plain(kwargs)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT),
                                                                         os.environ.get("PYTHONPATH")])),
               "ARPO_PARENT_PYTHON": sys.executable}  # e.g. the verl stage's token-id parity check
        proc = subprocess.run([python, "-m", "stages.core.isolate", str(request), str(response)], env=env,
                              timeout=timeout, cwd=os.getcwd())
        payload = json.loads(response.read_text()) if response.is_file() else {}
        if "input_error" in payload:  # deterministic: re-raised as such, so the task layer does not retry it
            kind = MissingInputError if payload.get("missing") else BadInputError
            raise kind(payload["input_error"])
        if proc.returncode != 0 or "result" not in payload:
            raise IsolatedStageError(f"{target} under {python} exited with code {proc.returncode}; "
                                     "its output is above in the log")
    hint = typing.get_type_hints(fn).get("return", Any)
    return TypeAdapter(hint).validate_python(payload["result"])


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
    except InputError as err:  # the message is the whole story (the parent re-raises it): no traceback
        Path(response_path).write_text(json.dumps({"input_error": str(err),
                                                   "missing": isinstance(err, FileNotFoundError)}))
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    Path(response_path).write_text(json.dumps({"result": _plain(result)}))


if __name__ == "__main__":
    from stages.core.env import configure_environment

    configure_environment()
    _run_child(sys.argv[1], sys.argv[2])
