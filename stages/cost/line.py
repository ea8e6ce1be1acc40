"""One line of a plan (`arpo plan`): a quantity per RL step and per run, with its basis (stages/cost/estimate.py
says what each basis means). Below the modules that build lines (estimate, summarizer), so neither imports the
other back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    what: str
    per_step: float | None
    per_run: float | None
    basis: str                  # exact | bound | measured | given | unknown
    error: float = 0.0          # stated relative error (measured / given); 0 for exact and bounds
    note: str = ""
