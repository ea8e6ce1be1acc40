"""math-verify in this process: the scorer the math workers run (stages/agent/math_worker.py), and what
`answer_match.math_equivalent_local` calls where the caller can kill the process itself (the eval pool).

`equivalent_here(pred, golds, timeout_s)`: the answer and the golds are screened (stages.agent.math_screen; a
refused answer, or no gold left, is not equal), then parsed and verified with a soft time limit on the main thread
(`_Deadline`) and none elsewhere. A C-level computation (a huge integer power) does not see the signal: only callers
that can kill the process should call this directly. Timeouts and errors are False.

It sits below both `answer_match` (which sends screened answers to the workers) and `math_worker` (whose workers
run it), so neither imports the other back.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

from stages.agent.math_screen import screen_math

_LATEX_DELIMS = ("$", "\\(", "\\[", "\\boxed")


def refused(pred: Any) -> bool:
    """An empty answer, or one the pre-screen refuses: it scores as not equal without a parse."""
    return pred is None or not str(pred).strip() or screen_math(str(pred)) is not None


def screened_golds(golds: Iterable[str]) -> list[str]:
    """The golds the screen lets through: no parse of the others could end in time either."""
    return [g for g in golds if screen_math(g) is None]


def _latex(text: str) -> str:
    # `\$` is an escaped dollar (currency), not a math delimiter; math-verify would read it as one and parse nothing
    text = text.replace("\\$", "").strip()
    return text if any(d in text for d in _LATEX_DELIMS) else f"${text}$"


class _Deadline:
    """`with _Deadline(s):` raises math-verify's TimeoutException after `s` seconds, then every 0.1 s until the
    block ends (sympy may catch one), when entered on the main thread; elsewhere it does nothing.

    math-verify's own timeouts are `signal.alarm` in whole seconds per parse/verify and cancel any outer alarm,
    so they are switched off and this one timer bounds the whole answer instead."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = threading.current_thread() is threading.main_thread()

    def __enter__(self) -> _Deadline:
        if self.armed:
            from math_verify.errors import TimeoutException

            def expire(signum: int, frame: object) -> None:
                if self.active:  # a late tick after __exit__ began must not escape the block
                    raise TimeoutException(f"math-verify ran past {self.seconds:g} s")

            self.active, self.start = True, time.monotonic()
            self.previous = signal.signal(signal.SIGALRM, expire)
            # an outer timer (pytest-timeout, a caller's alarm) is put back, less the time spent, on exit
            self.outer = signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.01), 0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            self.active = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            delay, interval = self.outer
            if delay > 0:
                signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - self.start), 0.001), interval)


def equivalent_here(pred: Any, golds: Iterable[str], timeout_s: float = 5.0) -> bool:
    """True when math-verify, run in this process, finds `pred` equal to one of the golds (module docstring)."""
    golds = screened_golds(golds)
    if refused(pred) or not golds:
        return False
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    # "timeout is disabled" is math-verify's warning about the timeouts _Deadline replaces
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        with _Deadline(timeout_s):
            target = parse(_latex(str(pred)), parsing_timeout=None)
            if not target:
                return False
            for g in golds:
                parsed = parse(_latex(g), parsing_timeout=None)
                if parsed and verify(parsed, target, timeout_seconds=None):
                    return True
    except (TimeoutException, RecursionError, ValueError, TypeError, OverflowError, MemoryError):
        return False
    return False
