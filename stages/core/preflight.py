"""The one pre-flight of a run: everything that can be checked before any work, for the stages a run selects.

    preflight(cfg, selection)      # raises an InputError naming the key, the file and the fix; else what it found

In order: the config (loaded and validated by stages.core.config.loader before this is called: a bad key never
gets here), the input files of every config section the selected stages read and the interpreters they run under
(stages.core.input_check), then each pre-flight check the stage table names for the selected stages
(stages.core.stage_spec: the seam checks, the memory model, the benchmark files), each distinct check once. A check
that reads the bootstrapped model (the seam checks) is skipped until it is on this machine: the flow runs it right
after the bootstrap stage (`after_bootstrap`).

`arpo run` calls it before Prefect is imported, the flow calls it first thing (a deployment's run has no CLI in
front of it), and `arpo rehearse` calls it once its toy model is built. The CLI's and the rehearsal's calls
`remember` their pass in this process, by the config and the selected stages, so the flow's call that follows
costs a dictionary lookup and a run is checked once; the flow's own pass is not remembered (a second run in one
process, a test's, checks its files again). The checks are named as strings in the table and imported here when a
selected stage needs them, so this module imports no stage package (stages/core imports only stages/core).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.core.fingerprint import hash_value
from stages.core.input_check import check_inputs
from stages.core.log import get_logger
from stages.core.selection import StageSelection
from stages.core.stage_spec import SEAMS, table

log = get_logger(__name__)
# the checks that read the bootstrap stage's output (the seam checks: its tokenizer); before it is on this machine
# they are skipped and return None, and the flow runs them once the bootstrap stage has (`after_bootstrap`)
READ_THE_MODEL = (SEAMS,)


@dataclass(frozen=True)
class Preflight:
    """What a passed pre-flight found: the stages it checked for, and each check's result by its target."""

    stages: tuple[str, ...]
    results: dict[str, Any] = field(default_factory=dict)

    def result(self, check: str) -> Any:
        """What the check `check` ("module:function", stages.core.stage_spec) returned; None when it did not run."""
        return self.results.get(check)


_PASSED: dict[str, Preflight] = {}


def preflight(cfg: Any, selection: StageSelection, remember: bool = False) -> Preflight:
    """Check `cfg` (the RunConfig) for the stages `selection` runs; raise the first problem as an InputError.
    `remember`: keep the pass for the flow this process starts next (its own call then checks nothing again)."""
    stages = selection.run
    memo = hash_value(cfg.model_dump(mode="json"), sorted(stages))
    if memo in _PASSED:
        return _PASSED[memo]
    check_inputs(cfg, stages)
    from stages.core.isolate import resolve

    results = {check: resolve(check)(cfg, stages) for check in table().checks(stages)}
    done = Preflight(tuple(s for s in table().stages if s in stages), results)
    if remember:
        _PASSED[memo] = done
    return done


def after_bootstrap(cfg: Any, selection: StageSelection, found: Preflight) -> Preflight:
    """Run the checks `found` (this run's pre-flight) skipped because the model was not on this machine yet, now
    that the bootstrap stage has put it there and before any stage trains on it: a first run checks its seams before
    SFT, and its cached rerun's pre-flight finds their pass remembered (a file lookup under <cache_root>/seams/)
    instead of importing transformers and LLaMA-Factory for them: 6.5 s of the first cached rerun on the 2-core box
    (docs/benchmarks.md, the tiny chain). Raises as `preflight` does; returns `found` with their results added."""
    stages = selection.run
    skipped = [c for c in table().checks(stages) if c in READ_THE_MODEL and found.result(c) is None]
    if not skipped:
        return found
    from stages.core.isolate import resolve

    return Preflight(found.stages, {**found.results, **{check: resolve(check)(cfg, stages) for check in skipped}})


def finished_folder(output_root: str, stage: str, **inputs: Any) -> Path | None:
    """The folder stage `stage` writes for `inputs` (the arguments its key function takes), when it is complete;
    None before the stage has run. A check that reads an earlier stage's output (the seam checks read the
    bootstrapped tokenizer) finds it here, by the table's key function, instead of building the path itself."""
    from stages.core.isolate import resolve
    from stages.core.workspace import MARKER, stage_path

    folder = stage_path(output_root, stage, resolve(table().spec(stage).key_target)(**inputs))
    return folder if (folder / MARKER).is_file() else None
