"""Errors that a retry cannot fix.

A stage task is retried when it fails (a server hiccup, a killed worker), but some failures come back on every
attempt with the same inputs: a bad config, a missing or malformed data file, a collapse alarm configured to stop
the run. Those subclass `DeterministicError`, and the task layer's retry condition (`tasks.stage_tasks.retryable`) fails
them at once, so the UI shows the error once instead of after every retry.

`InputError` is the "fix your input" kind: the CLI prints only its message (no traceback). Its subclasses also
subclass the builtin a caller would catch anyway (`ValueError`, `FileNotFoundError`), so existing handlers keep
working. Raise them for problems of the user's config and data only; a flaky network, a crashed server or an
exhausted GPU is not deterministic and stays retryable.
"""

from __future__ import annotations


class DeterministicError(Exception):
    """The same inputs raise it again: never retried."""


class InputError(DeterministicError):
    """The config or the data is wrong; rerunning with the same inputs cannot succeed."""


class BadInputError(InputError, ValueError):
    """A config value or a data row is invalid."""


class MissingInputError(InputError, FileNotFoundError):
    """A file the config names (data, benchmark, template, corpus) does not exist."""
