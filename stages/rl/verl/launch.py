"""The verl engine of the RL stage: prepare, check, run verl's PPO entry point, return its checkpoint.

    ref = run_rl_verl(cfg.rl, cfg.agent, policy, data, stage, cache_root, seed, dtype)   # via stages.rl.stage.run_rl

Runs under the RL stage's interpreter (`run.interpreters.rl` = verl's environment, `.venv-verl`). In the stage
folder it writes the data as verl parquet (rows validated and normalised by our reader, so both engines see the
same prompts), the plugin settings, the agent-loop YAML; then, before Ray starts, checks that `import verl` in a
fresh interpreter sees every registration (verl swallows plugin import errors) and that the prompt template gives
the same token ids as in the parent environment, and builds what the agent-loop workers will build (sandbox with one
real call, search backend and key, tool cache) here or on every node of rl.verl.ray_address
(stages/rl/verl/node_check.py); then runs `python -m verl.trainer.main_ppo <overrides>`.
While verl runs, a stall watchdog (stages/rl/verl/watchdog.py) stops a run that makes no step progress for
rl.verl.stall_timeout_s, with the stacks of its processes in `<stage>/stacks/` and an error naming the stuck part.
Re-running after a crash resumes: `trainer.resume_mode=auto` loads the newest `checkpoints/global_step_*`
(weights, optimizer, RNG, dataloader) and trees are seeded from (seed, step, dataset index).
The result is `CheckpointRef(format="verl_fsdp")` at `global_step_<N>/actor`, which the merge stage turns into an
HF folder with `stages.rl.fsdp_merge` and checks with its parity probe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages.agent.toolbox import corpus_path
from stages.core import reporter, tracking
from stages.core.atomic import write_json, write_jsonl, write_text
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection
from stages.core.log import get_logger
from stages.core.refs import CheckpointRef, DatasetRef, ModelRef
from stages.core.rl_parquet import SCHEMA, RLRow, read_rl_parquet
from stages.generation.models import policy_folder, tokenizer_folder
from stages.rl.retention import prune_verl_checkpoints
from stages.rl.step_metrics import plot_curves
from stages.rl.tree_report import finish_pages, publish_trees
from stages.rl.verl.cpu_mode import CPU_ENV, plugin_modules
from stages.rl.verl.mapping import TREE_AGENT, VerlPaths, external_modules, model_type_of, verl_overrides
from stages.rl.verl.monitor import Follower, LiveReport, read_steps
from stages.rl.verl.parity import check_parity
from stages.rl.verl.resources import preflight
from stages.rl.verl.settings import SETTINGS_ENV, PluginSettings, write_settings
from stages.rl.verl.watchdog import STACK_DIR_ENV, StallWatch

log = get_logger(__name__)
PARITY_PROMPTS = 4


class VerlPluginError(RuntimeError):
    pass


def write_verl_parquet(rows: list[RLRow], path: Path) -> Path:
    """Our validated rows in verl's RL schema (prompt messages, reward_model, extra_info.index, ability)."""
    records = [{"data_source": r.data_source, "prompt": [{"content": c, "role": role} for role, c in r.prompt],
                "ability": r.ability, "reward_model": {"ground_truth": r.ground_truth, "style": "rule"},
                "extra_info": {"index": r.index, "need_tools_kwargs": False, "question": r.question, "split": ""},
                "metadata": None} for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), tmp)
    tmp.replace(path)
    return path


def plugin_env(settings_path: Path | None = None, plugin_modules: list[str] | None = None) -> dict[str, str]:
    """The environment of verl's driver: our plugin module (after rl.verl.plugin_modules), the settings, this
    project on the path."""
    from stages.core.env import PROJECT_ROOT

    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": external_modules(list(plugin_modules or [])),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
    if settings_path is not None:
        env[SETTINGS_ENV] = str(settings_path)
    return env


def verify_plugin(python: str = sys.executable, env: dict[str, str] | None = None) -> dict[str, bool]:
    """Fail before Ray starts unless a fresh `import verl` under `python` sees all our registrations."""
    proc = subprocess.run([python, "-m", "stages.rl.verl.preflight"], env=env or plugin_env(), capture_output=True,
                          text=True, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise VerlPluginError(f"the verl plugin check failed under {python} (exit {proc.returncode}):\n"
                              f"{proc.stderr[-3000:]}")
    report = json.loads(lines[-1])
    if not report["ok"]:
        missing = [name for name, ok in report["found"].items() if not ok]
        raise VerlPluginError(f"verl under {python} does not see {missing}; {report['error']}")
    return report["found"]


def agent_loop_yaml() -> str:
    return f"- name: {TREE_AGENT}\n  _target_: stages.rl.verl.agent_loop.ArpoTreeAgentLoop\n"


def plugin_settings(cfg: RLSection, agent: AgentSection, data: DatasetRef, cache_root: Path, seed: int,
                    model_dir: Path, tree_failures: Path | None = None) -> PluginSettings:
    from transformers import AutoTokenizer, GenerationConfig

    from stages.generation.base import eos_ids_of

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        generation = GenerationConfig.from_pretrained(str(model_dir))
    except OSError:
        generation = None
    return PluginSettings(algorithm=cfg.algorithm, rollout=cfg.rollout, agent=agent, advantage=cfg.advantage,
                          alarms=cfg.alarms, reward=cfg.trainer.reward,
                          seed=seed,
                          corpus_path=corpus_path(agent, data),
                          cache_root=str(Path(cache_root).resolve()),
                          max_concurrent_trees=cfg.verl.max_concurrent_trees,
                          tree_failures_path=str(tree_failures) if tree_failures else None,
                          eos_token_ids=sorted(eos_ids_of(tokenizer, generation)))


def prepare(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef, stage: Path,
            cache_root: Path, seed: int, dtype: str) -> tuple[list[str], VerlPaths, list[RLRow]]:
    """Write the stage's inputs and return verl's overrides (no verl import; tested on CPU)."""
    if isinstance(policy, CheckpointRef) and policy.format == "lora":
        raise ValueError("rl.engine=verl trains full weights; merge the LoRA adapter first (sft.finetuning_type=full "
                         "or run the merge stage on the SFT output)")
    model_dir = policy_folder(policy)
    rows = read_rl_parquet(data.file("rl_train"))
    valid = read_rl_parquet(data.file("rl_valid")) if "rl_valid" in data.files else rows[:1]
    inputs = stage / "verl_inputs"
    paths = VerlPaths(model=str(model_dir), train_file=str(write_verl_parquet(rows, inputs / "train.parquet")),
                      val_file=str(write_verl_parquet(valid, inputs / "valid.parquet")),
                      checkpoints=str(stage / "checkpoints"), settings=str(inputs / "plugin_settings.json"),
                      agent_loops=str(write_text(inputs / "agent_loops.yaml", agent_loop_yaml())),
                      rollout_dump=str(stage / "rollouts"), experiment=stage.name)
    failures = inputs / "tree_failures.jsonl"   # this attempt's failed trees (stages/rl/verl/failures.py)
    failures.unlink(missing_ok=True)
    write_settings(plugin_settings(cfg, agent, data, cache_root, seed, Path(tokenizer_folder(policy)), failures),
                   paths.settings)
    attempt = stage / "verl_metrics" / f"attempt_{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    attempt.parent.mkdir(parents=True, exist_ok=True)
    handoff = tracking.current().handoff(nested="verl")  # verl's own logger: a run nested in the stage's
    overrides = verl_overrides(cfg, dtype, seed, paths, model_type_of(model_dir), handoff)
    overrides.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={attempt}")
    # every Ray process of the run registers its faulthandler stack dump there (stages/rl/verl/watchdog.py)
    overrides.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{STACK_DIR_ENV}={stage / 'stacks'}")
    write_text(inputs / "overrides.txt", "\n".join(overrides) + "\n")
    return overrides, paths, rows


def total_steps(cfg: RLSection, n_rows: int) -> int:
    """verl's step count: rl.trainer.total_steps, else epochs x full batches (verl drops the last partial one)."""
    return cfg.trainer.total_steps or cfg.trainer.epochs * (n_rows // cfg.trainer.train_batch_size)


def latest_step(checkpoints: Path) -> int | None:
    marker = checkpoints / "latest_checkpointed_iteration.txt"
    return int(marker.read_text().strip()) if marker.is_file() else None


def attempts(stage: Path) -> list[Path]:
    return sorted((stage / "verl_metrics").glob("attempt_*.jsonl"))


def collect_metrics(stage: Path) -> list[dict]:
    """verl's file-logger rows of every attempt -> metrics.jsonl in our names (stages.rl.verl.monitor), one row
    per step (a resumed step's last)."""
    rows = read_steps(attempts(stage))
    history = [rows[s] for s in sorted(rows)]
    write_jsonl(stage / "metrics.jsonl", history)
    return history


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the launcher dies, even by SIGKILL (Linux PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def leftover_processes(settings_path: str) -> list[int]:
    """Processes of an earlier attempt of this stage (found by the settings path every verl process has in its
    environment): when the launcher is SIGKILLed, its parent-death signal takes main_ppo, Ray's GCS, raylet and
    workers down, but Ray's per-node agents (dashboard, runtime-env) outlive their raylet."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(SETTINGS_ENV) == settings_path:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def reap_leftovers(settings_path: str) -> None:
    pids = leftover_processes(settings_path)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if pids:
        log.warning("verl: killed %d processes an earlier attempt of this stage left behind", len(pids))


def run_main_ppo(overrides: list[str], env: dict[str, str], stage: Path,
                 on_poll: Callable[[], object] | None = None, poll_s: float = 5.0, watch: StallWatch | None = None,
                 command: list[str] | None = None) -> int:
    """`python -m verl.trainer.main_ppo` (or `command`) in its own process group, killed when it ends, when this
    process is interrupted (or `on_poll`, called every `poll_s` while verl runs, raises; or `watch` finds the run
    stalled: RunStalled, with the stacks in the stage folder), or (parent-death signal) when this process is killed:
    the Ray cluster verl starts (GCS, raylet, workers, vLLM; Ray's head processes share the driver's fate) never
    outlives the stage."""
    with open(stage / "verl.log", "a") as console:
        argv = command or [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
        proc = subprocess.Popen(argv, env=env, cwd=stage,
                                stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
        try:
            while True:
                try:
                    code = proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    code = None
                if on_poll:
                    on_poll()
                if code is not None:
                    return code
                if watch:
                    watch.check(proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def run_rl_verl(cfg: RLSection, agent: AgentSection, policy: ModelRef | CheckpointRef, data: DatasetRef,
                stage: Path, cache_root: Path, seed: int = 0, dtype: str = "bfloat16") -> CheckpointRef:
    overrides, paths, rows = prepare(cfg, agent, policy, data, stage, cache_root, seed, dtype)
    env = plugin_env(Path(paths.settings), plugin_modules(cfg.verl))
    if cfg.verl.cpu_mode:   # stages/rl/verl/cpu_mode.py
        env = {**env, **CPU_ENV}
    resources = preflight(cfg.verl, paths.settings)   # raises with the fix before Ray starts
    found = verify_plugin(sys.executable, env)
    parity = check_parity(str(tokenizer_folder(policy)), [r.messages for r in rows[:PARITY_PROMPTS]])
    write_json(stage / "verl_inputs" / "preflight.json", {"registrations": found, "token_parity": parity,
                                                          "resources": resources})
    log.info("verl: %d overrides (stage %s); plugin %s; launching verl.trainer.main_ppo", len(overrides), stage,
             sorted(found))
    reap_leftovers(paths.settings)
    prune_verl_checkpoints(Path(paths.checkpoints), cfg.trainer.keep_checkpoints)  # a crashed attempt's old ones
    resumed = latest_step(Path(paths.checkpoints)) or 0
    env[STACK_DIR_ENV] = str(stage / "stacks")   # every process of the run dumps its stacks there on SIGUSR2
    watch = StallWatch(cfg.verl.stall_timeout_s, stage, paths.settings)
    with reporter.track("rl", f"RL ({cfg.algorithm}, verl)", total=total_steps(cfg, len(rows)), done=resumed) as bar:
        live = LiveReport(cfg, stage, bar, resumed)

        def on_step(row: dict) -> None:
            watch.progress(row["step"])
            live.on_step(row)

        try:
            returncode = run_main_ppo(overrides, env, stage, Follower(lambda: attempts(stage), on_step).poll,
                                      watch=watch)
        finally:
            finish_pages(cfg, stage)  # an alarm stop included: a tree page per dumped step (tree_report.py)
    history = collect_metrics(stage)
    if history:
        plot_curves(history, stage / "curves.png")
    publish_trees(cfg, stage)  # the tree pages of the steps since the last report (stages/rl/tree_report.py)
    if returncode != 0:
        raise RuntimeError(f"verl.trainer.main_ppo exited with code {returncode}; see {stage / 'verl.log'}. "
                           "Re-running the stage resumes from the newest checkpoint")
    step = latest_step(Path(paths.checkpoints))
    if step is None:
        raise RuntimeError(f"verl finished without a checkpoint in {paths.checkpoints}; set rl.trainer.save_every")
    prune_verl_checkpoints(Path(paths.checkpoints), cfg.trainer.keep_checkpoints)
    actor = Path(paths.checkpoints) / f"global_step_{step}" / "actor"
    return CheckpointRef(path=str(actor), fingerprint="", format="verl_fsdp", step=step,
                         meta={"engine": "verl", "metrics": str(stage / "metrics.jsonl"), "log": str(stage / "verl.log"),
                               "curves": str(stage / "curves.png"), "rollouts": paths.rollout_dump})
