"""What a stage knows of the pipeline's tracker: a plain value the flow puts into the environment.

The flow opens the pipeline's run (stages.core.tracking.pipeline) and writes this context as JSON into
`ARPO_TRACKING`; a stage reads it back (in the flow's process, or under another interpreter: the variable crosses
with the rest of the environment), so stages never import Prefect and no stage's key covers the tracking section.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

TRACKING_ENV = "ARPO_TRACKING"
RECORD_FILE = "tracking.json"   # in a stage folder: the run that produced it (written before the folder is finished)
CARD_FILE = "algorithm_card.md"  # the algorithm card (stages/rl/card.py): in the RL stage folder and the run's folder
NOT_METRICS = frozenset({"step", "pid", "resumed_from", "batch_position"})  # metrics.jsonl fields that are no curve


class TrackerUnavailable(RuntimeError):
    """The tracker could not be reached or refused a call while `tracking.required` is true."""


@dataclass(frozen=True)
class TrackingContext:
    """backend: a name of the "tracking backend" registry; uri: resolved (an MLflow URI, or the folder of the wandb /
    tensorboard runs); experiment: MLflow experiment / W&B project / TensorBoard folder; parent_id / parent_name:
    the pipeline's run; tags: on every run; required: a failure raises instead of warning once; disabled: why the
    tracker is off for this run (the flow found it dead: the stages do not try again)."""

    backend: str = "none"
    uri: str = ""
    experiment: str = "arpo"
    parent_id: str | None = None
    parent_name: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    required: bool = False
    wandb_mode: str = "offline"
    disabled: str | None = None

    @property
    def active(self) -> bool:
        return self.backend != "none" and not self.disabled

    def to_env(self, environ: dict[str, str] | os._Environ | None = None) -> None:
        (os.environ if environ is None else environ)[TRACKING_ENV] = json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ | None = None) -> TrackingContext | None:
        """The context the flow set, or None (a stage run alone, a unit test, a malformed value)."""
        text = (os.environ if environ is None else environ).get(TRACKING_ENV)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (ValueError, TypeError):
            return None

    def with_disabled(self, reason: str | None) -> TrackingContext:
        return replace(self, disabled=reason)

    def explain(self, what: str, reason: str) -> str:
        """The error of a required tracker that failed: what, where, and the two fixes."""
        where = f"{self.backend} at {self.uri}" if self.uri else self.backend
        hint = (" (start it: mlflow server --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000, "
                "docs/ui.md \"Where the curves go\")" if self.backend == "mlflow" and "://" in self.uri
                and not self.uri.startswith(("sqlite:", "file:")) else "")
        return (f"tracking.required is true and the tracker {where} failed to {what}: {reason}{hint}. Fix the "
                "tracker or tracking.tracking_uri, or set tracking.required=false to go on without it (metrics.jsonl "
                "keeps every number)")


def stage_run_name(stage: str, key: str) -> str:
    """`rl-3f2a9c1d0e`: the stage and the start of its key (its folder under outputs/<stage>/)."""
    return f"{stage}-{key[:10]}" if key else stage


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The curves of a metrics row: its numbers (bools and counters such as step or pid left out)."""
    return {k: float(v) for k, v in row.items()
            if k not in NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool)}


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as `section.key` -> text (lists and empty mappings as JSON): the runs' params."""
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, item in value.items():
            out |= flatten(item, f"{prefix}{key}.")
        return out
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return {prefix.rstrip("."): text}


_SAFE = re.compile(r"[^\w./\- :]")


def safe_key(name: str) -> str:
    """A metric or param name MLflow accepts (letters, digits, _ - . / : space): `pass@1` -> `pass_at_1`, as verl's
    MLflow logger writes it (verl/utils/tracking.py _MlflowLoggingAdapter._sanitize_key)."""
    return _SAFE.sub("_", re.sub("/+", "/", name.replace("@", "_at_")))
