"""Step time of our RL trainer vs TRL's GRPOTrainer, one run, same model / prompts / lengths.

    .venv-trl/bin/python bench/bench_trl.py [--steps 4] [--prompts 2] [--group 4] [--max-new 32]

TRL: the newest release that installs beside the project's pins. LLaMA-Factory 0.9.5 caps the main environment at
trl 0.24.0; trl 1.x needs datasets >= 4.7 (we pin 4.0.0 for LLaMA-Factory); trl 0.29.1 is the newest whose
requirements (transformers >= 4.56.2, datasets >= 3, accelerate >= 1.4) our pins meet. It goes into a scratch
environment that sees the main one's packages and adds only trl:

    /path/to/python3.11 -m venv .venv-trl
    echo "$PWD/.venv/lib/python3.11/site-packages" > .venv-trl/lib/python3.11/site-packages/main-venv.pth
    .venv-trl/bin/pip install --no-deps trl==0.29.1

(Under `.venv/bin/python` the bench runs trl 0.24.0 with two shims, as before.) Both train SmolLM2-135M-Instruct
(the tiny profile's model) with plain GRPO, no tools (our local engine's call limit is 0), on the same synthetic
questions, group size, completion budget, lr, one PPO epoch, no KL / reference model, token-mean loss (TRL's
`dapo`), one optimizer step per RL step, fp32 on CPU, one thread, and the same batch reward function (the
fraction of vowels among the completion's letters: it varies between samples, so both produce real gradients).
TRL generates with `model.generate` and skips the old-log-prob pass when num_iterations = 1; so does our trainer
(`rl.trainer.old_logprobs: auto`), which samples through the KV-cached tree rollout and runs each group's prompt
once in the update. Our checkpoint save is excluded from the step time (TRL saves nothing here). The first step of
each is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()

import torch

from stages.agent.rewards import REWARDS, Reward


def vowel_fraction(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


@REWARDS.register("bench_vowels")
def bench_vowels(responses: list[str], ground_truths: list[str], abilities: list[str]) -> list[Reward]:
    return [Reward(vowel_fraction(r), False, "vowel fraction", None, 0.0) for r in responses]


def setup(args):
    from stages.bootstrap import bootstrap_model
    from stages.core.config.loader import load_config
    from stages.data import prepare_data

    overrides = ["rl.algorithm=grpo", f"rl.rollout.n={args.group}",
                 f"rl.rollout.initial_rollouts={args.group}", f"rl.trainer.train_batch_size={args.prompts}",
                 f"rl.trainer.ppo_mini_batch_size={args.prompts}",
                 f"rl.trainer.micro_batch_size={args.prompts * args.group}",
                 f"rl.rollout.max_response_length={args.max_new}", f"rl.trainer.total_steps={args.steps}",
                 f"rl.trainer.save_every={args.steps}", "rl.rollout.call_limit=0", "rl.trainer.reward=bench_vowels",
                 "rl.trainer.dump_rollouts=false", f"rl.optim.lr={args.lr}"]
    cfg = load_config("tiny-cpu", overrides=overrides)
    root = PROJECT_ROOT / ".cache" / "bench-rl"  # own folder: other benches clean theirs
    return cfg, bootstrap_model(cfg.model, root, PROJECT_ROOT / ".cache"), prepare_data(cfg.data, root)


def run_ours(cfg, model, data, workdir: Path) -> list[dict]:
    from stages.core.atomic import read_jsonl
    from stages.rl.trainer import RLTrainer

    RLTrainer(cfg.rl, cfg.agent, model, data, workdir / "ours", PROJECT_ROOT / ".cache", seed=0).train()
    rows = read_jsonl(workdir / "ours" / "metrics.jsonl")
    return [{"step_s": r["timing/step_s"] - r["timing/checkpoint_s"], "tokens": r["response/length"] *
             r["rollout/trajectories"], **{k: r[f"timing/{k}_s"] for k in ("rollout", "old_logprob", "update")}}
            for r in rows]


def trl_compat() -> None:
    """trl 0.24 (not 0.29) expects transformers 4's `_is_package_available` (a bool); transformers 5 returns (bool, version),
    a tuple that is always truthy, so trl believes mergekit/deepspeed/... are installed and fails importing them.
    Reduce the flags to their bool before trl's trainers are imported."""
    import trl.import_utils as flags

    for name, value in list(vars(flags).items()):
        if name.startswith("_") and name.endswith("_available") and isinstance(value, tuple):
            setattr(flags, name, bool(value[0]))


def run_trl(cfg, model, data, args, workdir: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    trl_compat()
    from trl import GRPOConfig, GRPOTrainer

    from stages.core.rl_parquet import read_rl_parquet

    rows = read_rl_parquet(data.file("rl_train"))[: args.prompts * args.steps]
    dataset = Dataset.from_list([{"prompt": r.messages} for r in rows])
    times: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append({"step_s": time.perf_counter() - self.t0})

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs and times:
                times[-1]["tokens"] = logs["completions/mean_length"] * args.prompts * args.group

    def reward(completions, **kw):
        return [vowel_fraction(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    import inspect

    accepted = inspect.signature(GRPOConfig.__init__).parameters
    optional = {"max_prompt_length": cfg.rl.rollout.max_prompt_length,  # gone in trl 0.29
                "loss_type": "dapo"}                                     # token mean, as ours (trl >= 0.20)
    config = GRPOConfig(output_dir=str(workdir / "trl"), per_device_train_batch_size=args.prompts * args.group,
                        num_generations=args.group, max_completion_length=args.max_new,
                        learning_rate=args.lr, beta=0.0, num_iterations=1, gradient_accumulation_steps=1,
                        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                        bf16=False, temperature=1.0, shuffle_dataset=False, seed=0, lr_scheduler_type="constant",
                        weight_decay=0.01, max_grad_norm=1.0, disable_tqdm=True,
                        **{k: v for k, v in optional.items() if k in accepted})
    tokenizer = AutoTokenizer.from_pretrained(model.path, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32, attn_implementation="sdpa")
    policy.warnings_issued = {}  # trl 0.24 writes into this transformers-4 attribute
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    return times


def summary(name: str, rows: list[dict]) -> dict:
    timed = rows[1:] or rows  # first step = warm-up
    step = statistics.median(r["step_s"] for r in timed)
    tokens = statistics.mean(r.get("tokens", float("nan")) for r in timed)
    print(f"{name:>6}: median step {step:7.2f} s   completion tokens/step {tokens:7.1f}   "
          f"ms per completion token {1000 * step / tokens:7.1f}   steps {[round(r['step_s'], 2) for r in rows]}")
    phases = [k for k in ("rollout", "old_logprob", "update") if k in timed[0]]
    if phases:
        print("        phases (median s): " + ", ".join(f"{k} {statistics.median(r[k] for r in timed):.2f}"
                                                        for k in phases))
    return {"step": step, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg, model, data = setup(args)
    with tempfile.TemporaryDirectory(dir=PROJECT_ROOT / ".cache") as tmp:
        theirs = summary("TRL", run_trl(cfg, model, data, args, Path(tmp)))
        ours = summary("ours", run_ours(cfg, model, data, Path(tmp)))
    from importlib.metadata import version

    print(f"TRL {version('trl')}, transformers {version('transformers')}, torch {torch.__version__}")
    print(f"ratio ours/TRL: step time {ours['step'] / theirs['step']:.2f}x, time per completion token "
          f"{(ours['step'] / ours['tokens']) / (theirs['step'] / theirs['tokens']):.2f}x "
          f"(P={args.prompts} prompts x G={args.group}, {args.max_new} new tokens max, {args.steps} steps)")
    write_result("trl", {"step_x": round(ours["step"] / theirs["step"], 3),
                         "token_x": round((ours["step"] / ours["tokens"]) / (theirs["step"] / theirs["tokens"]), 3),
                         "ours_step_s": round(ours["step"], 2), "trl_step_s": round(theirs["step"], 2),
                         "trl": version("trl")},
                 summary="{step_x:.2f}x TRL {trl}'s step time ({token_x:.2f}x per completion token)",
                 what="our GRPO step vs TRL's `GRPOTrainer` on the same model and prompts",
                 command="bench/bench_trl.py", details="rl.md#benchmarks",
                 conditions={**vars(args), "transformers": version("transformers"), "torch": torch.__version__})


if __name__ == "__main__":
    main()
