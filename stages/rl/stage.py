"""The RL stage's entry point: `run_rl` (the stage folder, its key, the algorithm card) hands the training to the
engine `rl.engine` names in the engine registry (stages/rl/engines.py: local = stages/rl/trainer.py, verl =
stages/rl/verl/).

    ckpt = run_rl(cfg.rl, cfg.agent, policy, data, output_root, cache_root, seed=cfg.run.seed)   # CheckpointRef

Imports point one way: this module -> the engine registry -> the engines; neither engine imports this module.
"""

from __future__ import annotations

from pathlib import Path

from stages.core import tracking
from stages.core.algorithm_spec import ALGORITHMS
from stages.core.atomic import read_jsonl, write_text
from stages.core.codeversion import code_version
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.fingerprint import hash_value
from stages.core.input_files import check_rl_rows
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.core.tracking.context import CARD_FILE  # written before any work
from stages.core.workspace import stage_dir
from stages.rl.card import algorithm_card, card_markdown
from stages.rl.engines import RL_ENGINES, engine_version
from stages.rl.identity import training_identity
from stages.rl.publish import publish_results
from stages.rl.retention import drop_optimizer_state
from stages.rl.step_identity import step_identity, write_identity

log = get_logger(__name__)


def run_rl(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
           output_root: str | Path, cache_root: str | Path, seed: int = 0, force: bool = False,
           dtype: str = "float32") -> CheckpointRef:
    """Train `policy` with GRPO / ARPO / AEPO on `data`'s rl_train file with the engine `cfg.engine` (local: this
    process; verl: verl over Ray); returns the final checkpoint. `dtype` is model.dtype.

    With `cfg.enabled` false the policy is passed through (a ModelRef becomes an hf CheckpointRef).
    """
    if not cfg.enabled:
        return passthrough(policy)
    ablation = components_off(cfg)
    if ablation:
        log.warning("rl.algorithm=%s with %s switched off: an ablation (AEPO's entropy-aware advantage off is how "
                    "the published AEPO run trained; algorithm_card.md says so)", cfg.algorithm, ", ".join(ablation))
    engine = RL_ENGINES.get(cfg.engine)
    out = stage_dir(output_root, "rl", rl_key(cfg, agent, policy, data, seed, dtype), force=force)
    if not out.complete:
        check_rl_rows(cfg, data)  # before a model is loaded or Ray started
        write_text(out.path / CARD_FILE, card_markdown(algorithm_card(cfg, agent)))
        base = base_model(policy)  # `arpo plan` projects runs of these per-step settings from this one's metrics
        write_identity(out.path, step_identity(cfg, agent, base.name if base else "", dtype))
        with tracking.stage_run("rl", out.path) as run:  # each engine logs its metrics.jsonl rows into it
            run.log_artifact(out.path / CARD_FILE)
            result = engine(cfg, agent, policy, data, out.path, Path(cache_root), seed, dtype)
            if not cfg.trainer.keep_optimizer_state:  # before `finish` hashes the content
                drop_optimizer_state(Path(result.path), result.format)
            content = Path(result.path) / "model" if result.format == "trainer" else Path(result.path)
            out.finish(content=content, final=result.path, steps=result.step, format=result.format,
                       meta=result.meta)
    elif (out.path / "metrics.jsonl").is_file():  # trained before (another run's Prefect cache), either engine:
        publish_results(cfg, out.path, read_jsonl(out.path / "metrics.jsonl"), replot=False)  # its curves here too
    marker = out.marker()
    return CheckpointRef(path=marker["final"], fingerprint=out.fingerprint, format=marker.get("format", "trainer"),
                         base=base_model(policy), step=int(marker["steps"]),
                         meta={"algorithm": cfg.algorithm, "engine": cfg.engine, **marker.get("meta", {}),
                               **({"components_off": ablation} if ablation else {})})


def rl_key(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef, seed: int = 0,
           dtype: str = "float32", python: str | None = None) -> str:
    """The stage's one key (its folder name and its Prefect cache key): the training identity, the agent, the
    inputs, the code of the runtime and of RL, and the engine's version in the interpreter the stage runs under
    (`python`; None = this one)."""
    return hash_value(training_identity(cfg), agent, policy.fingerprint, data.fingerprint, seed, dtype,
                      code_version(__name__),
                      engine_version(cfg.engine, python))


def components_off(cfg: RLSection) -> list[str]:
    """The algorithm's components (stages/core/algorithm_spec.py) a config switches off explicitly (allowed: the
    reference has one switch per component and the AEPO paper ablates each; the run's artifacts name them)."""
    return ALGORITHMS.get(cfg.algorithm).components_off(cfg)


def passthrough(policy: ModelRef | CheckpointRef) -> CheckpointRef:
    if isinstance(policy, CheckpointRef):
        return policy
    return CheckpointRef(path=policy.path, fingerprint=policy.fingerprint, format="hf", base=policy,
                         meta={"rl": "disabled"})


def base_model(policy: ModelRef | CheckpointRef) -> ModelRef | None:
    return policy if isinstance(policy, ModelRef) else policy.base


__all__ = ["components_off", "base_model", "passthrough", "rl_key", "run_rl"]
