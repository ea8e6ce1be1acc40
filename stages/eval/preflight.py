"""The evaluation's pre-flight check (named for the inference stage in stages/core/stage_spec.py, run by the one
pre-flight, stages.core.preflight): every configured benchmark's files, before any work
(stages.eval.benchmarks.check_benchmarks says what it checks)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stages.eval.benchmarks import check_benchmarks


def preflight_benchmarks(cfg: Any, stages: Iterable[str]) -> None:
    """`cfg` is the RunConfig; nothing to check when the evaluation is switched off (eval.enabled)."""
    if cfg.eval.enabled:
        check_benchmarks(cfg.eval.benchmarks, cfg.eval.data_root, cfg.eval.max_questions)
