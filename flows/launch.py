"""Starting a pipeline run from the command line (`arpo run`, `arpo rehearse`): the one pre-flight first, then the
flow. Imported by flows/cli.py and flows/rehearse_commands.py, importing neither (no cycle in flows/).

Nothing heavy is imported before the cache can answer: the config, the stage selection and the pre-flight are
`stages.core` modules; Prefect comes with the flow, torch only when a stage task runs (tasks.stage_tasks applies
`run.torch_threads` then).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


class ServerLost(Exception):
    """The Prefect server this run reports to stopped answering mid-run."""


def run_pipeline(profile: str, overrides: list[str], args: argparse.Namespace, cfg: Any = None) -> dict:
    """Check everything that can be checked before work starts (stages.core.preflight), then run the flow;
    returns the flow's summary. `cfg`: the config of (profile, overrides) when the caller loaded it already."""
    from flows.server import ephemeral_server_ready, use_local_server_if_running
    from stages.core.config.loader import load_config
    from stages.core.env import free_cpu_threads
    from stages.core.preflight import preflight
    from stages.core.selection import select_stages
    from stages.core.tracking.pipeline import preload

    cfg = cfg if cfg is not None else load_config(profile, overrides)  # fail fast on config errors
    selection = select_stages(args.only, args.until, args.refresh, args.refresh_from)
    preflight(cfg, selection, remember=True)  # inputs, interpreters, seams, memory, benchmarks: before Prefect
    threads = cfg.run.torch_threads or free_cpu_threads()  # the cores free at start
    ui = use_local_server_if_running(ephemeral=args.ephemeral, wait=False)  # a temporary one boots meanwhile
    pipeline = import_flow()
    if ui is None:  # while the temporary server boots on the other core: the tracker's library, which the flow's
        preload(cfg.tracking)  # first task imports (mlflow: 1.5 s of CPU), then wait for the server
        ephemeral_server_ready()
    from tasks.stage_tasks import TORCH_THREADS_ENV

    os.environ[TORCH_THREADS_ENV] = str(threads)  # torch's threads, applied when a stage task runs here
    print(f"profile {cfg.profile}: {selection.describe()}")
    try:
        summary = pipeline(profile=profile, overrides=overrides, only=args.only, until=args.until,
                           refresh=args.refresh, refresh_from=args.refresh_from, verify=args.verify)
    except Exception as err:
        from stages.core.errors import DeterministicError
        from stages.core.procs import healthy

        if ui and not isinstance(err, DeterministicError) and not healthy(f"{ui}/api/health"):
            raise ServerLost(f"the Prefect server at {ui} stopped answering during the run ({type(err).__name__}: "
                             f"{err}). Finished stages are kept in {cfg.run.output_root}/ and are reused: start the "
                             "server again (`arpo server start`), or add --ephemeral, and rerun the same command"
                             ) from err
        raise
    print(f"\nrun record: {summary['run_dir']}")
    print(f"web UI:     {ui}" if ui else "web UI:     start it with `arpo server start`, then rerun (cached)")
    return summary


def import_flow() -> Any:
    """The pipeline flow, imported without the pandas import Prefect makes of its own accord: prefect 3.7.2's
    cache_policies.py (`_register_stable_transforms`, run at import, lines 33-46) imports pandas when it is installed,
    only to make DataFrame inputs hash stably under its INPUTS cache policy. No task here keys on its inputs that way
    (stage tasks key on tasks.stage_tasks.StageKey, the rest are NO_CACHE), and pandas is a third of a second of a cached
    run's start-up on the 2-core box (docs/benchmarks.md, the tiny chain). Later imports of pandas (the report stage
    builds its tables with it) work as usual."""
    blocked = "pandas" not in sys.modules
    if blocked:
        sys.modules["pandas"] = None  # type: ignore[assignment]  # `import pandas` raises ImportError meanwhile
    try:
        import prefect.cache_policies  # noqa: F401
    finally:
        if blocked:
            del sys.modules["pandas"]
    from flows.pipeline import pipeline

    return pipeline

