"""Errors that say "fix your input": a bad config, a missing or malformed data file.

They are deterministic (the same inputs fail the same way), so the task layer never retries them
(`tasks.common.retry_unless_input_error`) and the CLI prints only their message. Each subclasses the builtin a
caller would catch anyway (`ValueError`, `FileNotFoundError`, `KeyError`), so existing handlers keep working.
Raise them for problems of the user's config and data only; a flaky network, a crashed server or an exhausted
GPU is not an input error and stays retryable.
"""

from __future__ import annotations


class InputError(Exception):
    """The config or the data is wrong; rerunning with the same inputs cannot succeed."""


class BadInputError(InputError, ValueError):
    """A config value or a data row is invalid."""


class MissingInputError(InputError, FileNotFoundError):
    """A file the config names (data, benchmark, template, corpus) does not exist."""
