"""Errors that a retry cannot fix.

A stage task is retried when it fails (a server hiccup, a killed worker), but some failures come back on every
attempt with the same inputs: a config error, a collapse alarm configured to stop the run. Those subclass
`DeterministicError`, and the task layer's retry condition (tasks/common.py) fails them at once, so the UI shows
the error once instead of after every retry.
"""

from __future__ import annotations


class DeterministicError(Exception):
    """The same inputs raise it again: never retried."""
