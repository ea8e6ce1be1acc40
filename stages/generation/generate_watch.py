"""A time limit on an in-process generate call (the local engine's rollout: transformers or in-process vLLM).

    with GenerateWatch(limit_s, "round 3: 48 requests"):
        results = backend.generate(...)          # past limit_s: GenerateTimeout, with every thread's stack

The call stays on the calling thread (a backend's state, torch's grad mode and vLLM's engine belong to it). A timer
thread fires at the limit: it records the stacks of all threads (`GenerateTimeout.stacks`: where generation was
stuck) and raises `GenerateTimeout` in the calling thread (CPython's `PyThreadState_SetAsyncExc`), which delivers it
at the next Python bytecode the thread runs: a generation loop stuck in Python (a token loop that never meets its
stop, a server client polling) ends there. A thread blocked inside one C call (a CUDA kernel or collective that never
returns) gets it only when that call returns; the stacks are recorded at the limit all the same.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import traceback
from pathlib import Path


class GenerateTimeout(TimeoutError):
    """A generate request ran past its limit (rl.rollout.generate_timeout_s): an infrastructure failure."""

    stacks: str = ""


def thread_stacks() -> str:
    """Every thread's Python stack, named, as text (what py-spy / faulthandler would show)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class GenerateWatch:
    def __init__(self, limit_s: float | None, what: str) -> None:
        self.limit_s, self.what = limit_s, what
        self.fired, self.stacks = False, ""
        self._done = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> GenerateWatch:
        if self.limit_s is not None:
            self._thread = threading.get_ident()
            self._timer = threading.Timer(self.limit_s, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired, self.stacks = True, thread_stacks()
            _raise_in(self._thread, GenerateTimeout)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if self._timer is None:
                return
            with self._lock:
                self._done = True
                self._timer.cancel()
            if self.fired and exc_type is None:  # set but not delivered yet: take it back, raise it ourselves
                _raise_in(self._thread, None)
        except GenerateTimeout:  # delivered inside this method
            pass
        if self.fired:
            err = GenerateTimeout(f"no generate result within rl.rollout.generate_timeout_s={self.limit_s:g} s "
                                  f"({self.what}); the generation backend is stuck")
            err.stacks = self.stacks
            raise err from None


def stuck_generate(err: GenerateTimeout, stage: Path, step: int) -> GenerateTimeout:
    """The local trainer's error for a stuck generate: the stacks written to `<stage>/stacks/`, the message naming
    them and saying how to go on (the step was not saved, so a re-run resumes from the newest checkpoint)."""
    path = Path(stage) / "stacks" / f"generate_timeout_step{step}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(err.stacks or "(no stacks recorded)\n")
    out = GenerateTimeout(f"RL step {step} is stuck in the rollout's generate: {err}. Every thread's stack: {path}. "
                          "Re-running the stage resumes from the newest checkpoint")
    out.stacks = err.stacks
    return out
