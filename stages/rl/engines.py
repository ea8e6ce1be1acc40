"""RL engines: one registry (`rl.engine`), one signature.

    fn(cfg: RLSection, agent: AgentSection, policy, data: DatasetRef, stage: Path, cache_root: Path, seed: int,
       dtype: str) -> CheckpointRef        (stage = the content-addressed stage folder run_rl made)

- `local`: the one-process trainer (stages/rl/trainer.py) on one device; returns a `trainer` checkpoint.
- `verl`: verl's PPO trainer (the version its line in stages/core/engine_spec.py names) over Ray with our plugin
  (stages/rl/verl/); returns a `verl_fsdp` checkpoint (the actor folder of the last `global_step_<N>`), which the
  merge stage turns into an HF folder.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.engine_spec import ENGINES
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.core.registry import Registry

RLEngineFn = Callable[..., CheckpointRef]
RL_ENGINES: Registry[RLEngineFn] = Registry("RL engine")  # each line of stages/core/engine_spec.py, by name


@RL_ENGINES.register("local")
def local_engine(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
                 stage: Path, cache_root: Path, seed: int, dtype: str) -> CheckpointRef:
    from stages.rl.trainer import run_local

    return run_local(cfg, agent, policy, data, stage, cache_root, seed, dtype)


@RL_ENGINES.register("verl")
def verl_engine(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
                stage: Path, cache_root: Path, seed: int, dtype: str) -> CheckpointRef:
    spec = ENGINES.get("verl")
    installed = engine_version(spec.name)
    if installed != spec.version:
        raise RuntimeError(f"rl.engine=verl needs {spec.package}=={spec.version} in the RL stage's interpreter; this "
                           f"one has {installed or 'no verl'}. Build it with ./scripts/setup-gpu.sh and set "
                           "run.interpreters.rl=.venv-verl/bin/python (README: GPU runbook)")
    from stages.rl.verl.launch import run_rl_verl

    return run_rl_verl(cfg, agent, policy, data, stage, cache_root, seed, dtype)


def engine_version(engine: str, python: str | None = None) -> str:
    """What the cache key records about the engine: the version of the package its line names (verl) installed in
    the interpreter `python` (None = this one), empty for an engine that needs none (local) or when absent. The flow
    process asks the stage's interpreter, so its cache key and the stage folder's agree."""
    package = ENGINES.get(engine).package
    if not package:
        return ""
    if python and os.path.abspath(python) != os.path.abspath(sys.executable):
        return _version_in(os.path.abspath(python), package)
    try:
        return version(package)
    except PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=8)
def _version_in(python: str, dist: str) -> str:
    code = (f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\n"
            "except m.PackageNotFoundError: print('')")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"cannot ask {python} for its {dist} version: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()
