"""A rehearsal's two ends around the ordinary pipeline run, shared by `arpo rehearse` and the `arpo-rehearse` flow:
`prepare` (the rule's changes, the stand-in inputs, the toy model and every check that needs no training) and
`finish` (the report in the run record)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.rehearse.rule import Offline, Rehearsal, rehearsal_for


@dataclass
class Prepared:
    rehearsal: Rehearsal
    overrides: list[str]                         # the user's, then the rule's: what the pipeline runs with
    at_scale: dict[str, str]                     # the real profile's plan and memory lines
    seams: list[Any] | None = None               # stages.sft.seams.SeamResult, or None when not run
    started: float = field(default_factory=time.time)
    cfg: Any = None                              # the rehearsal's config (RunConfig): what the pipeline runs


def prepare(profile: str, user_overrides: list[str], offline: Offline, stages: Iterable[str],
            announce: Callable[[Prepared], None] | None = None) -> Prepared:
    """Everything before training; raises an InputError with the fix on a bad input or a failed seam check.
    `announce` sees the changes and the real-scale lines before the checks run (so they are shown either way).
    `stages`: the stages the rehearsal runs (its selection's)."""
    from stages.bootstrap import bootstrap_model
    from stages.core.config.loader import load_config
    from stages.core.input_check import check_inputs
    from stages.core.preflight import preflight
    from stages.core.selection import StageSelection
    from stages.core.stage_spec import SEAMS
    from stages.rehearse.real_scale import real_scale_checks

    started = time.time()
    real = load_config(profile, user_overrides)
    rehearsal = rehearsal_for(real, offline)
    overrides = [*user_overrides, *rehearsal.overrides()]
    cfg = load_config(profile, overrides)
    prepared = Prepared(rehearsal, overrides, real_scale_checks(real), started=started, cfg=cfg)
    if announce is not None:
        announce(prepared)
    if rehearsal.sft_standin:
        from stages.rehearse.standins import write_sft_standin

        write_sft_standin(cfg.data.train_path, rehearsal.sft_standin, cfg.sft.max_samples or 16,
                          cfg.sft.dataset_format)
    selection = StageSelection(run=frozenset(stages), refresh=frozenset())
    check_inputs(cfg, selection.run)  # the data files first (schema read): a bad one fails before the toy model
    if selection.runs("bootstrap"):   # the toy model next: the seam checks read its tokenizer (the flow finds it cached)
        bootstrap_model(cfg.model, cfg.run.output_root, cfg.run.cache_root)
    prepared.seams = preflight(cfg, selection, remember=True).result(SEAMS)  # the pipeline finds it passed
    return prepared


def finish(prepared: Prepared, summary: dict[str, Any]) -> Path:
    """Write rehearsal.md / rehearsal.json into the run record of the pipeline run `summary`."""
    from stages.rehearse.report import dpo_pairs, rl_steps, stage_timings, write_report

    return write_report(summary["run_dir"], prepared.rehearsal, prepared.seams, prepared.at_scale,
                        stage_timings(summary["refs"], prepared.started), time.time() - prepared.started,
                        rl_steps(summary["refs"]), dpo_pairs(summary["refs"]))
