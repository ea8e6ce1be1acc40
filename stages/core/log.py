"""One logger factory and one progress-bar factory for every stage (rich on a terminal, plain lines in CI).

Every stage logs under the `arpo` logger, which prints through one console handler and does not propagate.
Others may add handlers beside it (the task layer forwards records to the Prefect run); a stage running under
another interpreter swaps the console handler for one that hands records to its parent (`set_console`).
"""

from __future__ import annotations

import logging
import sys

from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

_console: logging.Handler | None = None


def _default_console() -> logging.Handler:
    if sys.stderr.isatty():
        return RichHandler(show_path=False, rich_tracebacks=False)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    return handler


def set_console(handler: logging.Handler) -> None:
    """Make `handler` the one that prints `arpo` records (replacing the previous one)."""
    global _console
    root = logging.getLogger("arpo")
    if _console is not None:
        root.removeHandler(_console)
    _console = handler
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def root_logger() -> logging.Logger:
    """The `arpo` logger, with its console handler in place."""
    if _console is None:
        set_console(_default_console())
    return logging.getLogger("arpo")


def get_logger(name: str) -> logging.Logger:
    root_logger()
    short = name.removeprefix("stages.")
    return logging.getLogger(f"arpo.{short}")


def progress(transient: bool = False) -> Progress:
    """A progress bar: `with progress() as bar: t = bar.add_task("rollouts", total=n); bar.advance(t)`.
    For a stage's main loop use `stages.core.reporter.track`, which also reports to the UI and logs the ETA."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), transient=transient,
                    disable=not sys.stderr.isatty())
