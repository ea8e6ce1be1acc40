"""The learning bench's jobs: one run of the design as a value, `Job(family, kind, seed)`, and its one text form
`<family>/<kind>:<seed>` (the worker's `--worker` argument and attempts.jsonl), read back by `Job.parse` alone.

A job's kind is the SFT policy's evaluation (`sft`), the SFT policy on each RL step's prompts (`sftsteps`,
bench/learning_baseline.py), an RL algorithm of the algorithm table, or an arm: the baseline algorithm with the
arm's overrides (`ARMS`: the lr = 0 control, the format-only reward of protocol v2).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

SFT, SFT_STEPS = "sft", "sftsteps"
SHARED_RUNS = (SFT, SFT_STEPS)  # the same for every tag that changes RL settings only: data, SFT, its evaluations
ARMS: dict[str, tuple[str, ...]] = {
    "control": ("rl.optim.lr=0",),                    # the save -> reload -> evaluate path alone (protocol v1)
    "format": ("rl.trainer.reward=format_only",),     # the format-only reward arm (protocol v2, docs/learning.md)
}


@dataclass(frozen=True)
class Job:
    family: str
    kind: str
    seed: int

    @classmethod
    def parse(cls, text: str) -> Job:
        """`<family>/<kind>:<seed>` -> Job; anything else is an error naming the form."""
        family, slash, run = text.partition("/")
        kind, colon, seed = run.partition(":")
        if not (slash and colon and family and kind and seed.isdigit()):
            raise ValueError(f"job {text!r} is not <family>/<kind>:<seed> (e.g. arith/grpo:0)")
        return cls(family, kind, int(seed))

    def __str__(self) -> str:
        return f"{self.family}/{self.kind}:{self.seed}"

    @property
    def run(self) -> str:
        """`<kind>:<seed>`: the job within its family (a record's results are keyed by it)."""
        return f"{self.kind}:{self.seed}"

    @property
    def file_stem(self) -> str:
        return f"{self.kind}-s{self.seed}"

    @property
    def shared(self) -> bool:
        return self.kind in SHARED_RUNS

    @property
    def trains(self) -> bool:
        """Does the job run RL (an algorithm or an arm)?"""
        return not self.shared

    def log_name(self, tag: str = "") -> str:
        return f"{self.family}-{self.file_stem}" + (f"@{tag}" if tag else "")


def algorithm_of(kind: str, baseline: str) -> str:
    """The RL algorithm a kind's config names: the baseline for SFT's jobs and the arms, else the kind itself."""
    return baseline if kind in SHARED_RUNS or kind in ARMS else kind


def arm_overrides(kind: str) -> list[str]:
    return list(ARMS.get(kind, ()))


def job_lists(args: argparse.Namespace, families: list[str]) -> tuple[list[Job], list[Job]]:
    """Every run of the design: SFT evaluated once per seed (cheap, first), then seed-major RL runs (a bench cut
    short still has whole seeds of every family and algorithm), the arms (the lr = 0 controls, the format-only
    runs); and SFT's per-step rewards."""
    seeds = [int(s) for s in args.seeds.split(",") if s]
    jobs = [Job(f, SFT, s) for s in seeds for f in families]
    jobs += [Job(f, a, s) for s in seeds for f in families for a in args.algos.split(",") if a]
    for arm in ARMS:
        jobs += [Job(f, arm, int(s)) for s in getattr(args, f"{arm}_seeds").split(",") if s for f in families]
    baselines = [] if args.no_sft_steps else [Job(f, SFT_STEPS, s) for s in seeds for f in families]
    return jobs, baselines


def result_path(root: Path, job: Job, tag: str = "", split: str = "eval_test", own_sft: bool = False) -> Path:
    """results/<family>[-valid][@<tag>]/<kind>-s<seed>.json: SFT's files are shared by every tag that changes RL
    settings only (`own_sft`: the tag changes SFT, data or the agent, so it has its own), the SFT policy's per-step
    rewards (sftsteps, on training prompts) by both splits too."""
    folder = job.family + ("-valid" if split == "rl_valid" and job.kind != SFT_STEPS else "")
    folder += f"@{tag}" if tag and (own_sft or not job.shared) else ""
    return Path(root) / "results" / folder / f"{job.file_stem}.json"
