"""One logger factory and one progress-bar factory for every stage (rich on a terminal, plain lines in CI)."""

from __future__ import annotations

import logging
import sys

from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_CONFIGURED = False


def get_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        root = logging.getLogger("arpo")
        if not root.handlers:
            handler = RichHandler(show_path=False, rich_tracebacks=False) if sys.stderr.isatty() \
                else logging.StreamHandler()
            if not sys.stderr.isatty():
                handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            root.propagate = False
        _CONFIGURED = True
    short = name.removeprefix("stages.")
    return logging.getLogger(f"arpo.{short}")


def progress(transient: bool = False) -> Progress:
    """A progress bar: `with progress() as bar: t = bar.add_task("rollouts", total=n); bar.advance(t)`."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), transient=transient,
                    disable=not sys.stderr.isatty())
