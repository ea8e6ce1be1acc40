"""Protocol v2 of the learning bench (issue 54, docs/learning.md): does RL teach more than the format?

The endpoint is **content accuracy**: the task's answer graded wherever the response gives one, whatever its format
(stages/eval/content.py, the eval stage's grader), counted over all questions. Format repair cannot move it. The
control arm is the baseline algorithm trained with the `format_only` reward (the task's format score, no
correctness: stages/agent/rewards.py), the same budget and seeds, so format repair and the sharpening any RL on the
policy's own samples brings happen in both arms; only the task reward can teach the answers.

- Primary: content accuracy of GRPO(task reward) - GRPO(format-only reward), paired by seed, seed-level t-test.
- First secondary: content accuracy of GRPO(task) - SFT, paired by seed.
- Exploratory: ARPO - GRPO and AEPO - GRPO in content accuracy, paired by seed, each with its MDE and the seeds it
  would need.

The pilot on `rl_valid` chooses the setting by a rule written before it runs (`choose_setting`).

    .venv/bin/python -m bench.learning_protocol <record>   # prints these tables beside v1's when the runs have content
    .venv/bin/python -m bench.learning_content learning-valid-v2-b8-lr1e-5 learning-valid-v2-b8-lr3e-5  # the choice
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from bench import learning_stats as st
from bench.learning_questions import SFT, Family, paired, policies, rate_SQ, read_per_question, runs_of

FORMAT_ARM = "format"       # the baseline algorithm under rl.trainer.reward=format_only
PRIMARY, SECONDARY, EXPLORATORY = "primary", "secondary", "exploratory"
COLLAPSE_ALARMS = ("reward_at_floor", "reward_collapse", "formed_but_wrong", "entropy_collapse", "tool_collapse",
                   "nonfinite_loss")


@dataclass(frozen=True)
class Endpoint:
    label: str
    a: str
    b: str
    role: str


def has_content(family: Family) -> bool:
    """Every run of the family was graded for content (a v1 record was not)."""
    return bool(family.runs) and all(run.content is not None for run in family.runs.values())


def content_endpoints(family: Family, algorithms: tuple[str, ...], baseline: str) -> list[Endpoint]:
    """The v2 endpoints the family's runs allow, primary first."""
    have = set(policies(family))
    out = []
    if {baseline, FORMAT_ARM} <= have:
        out.append(Endpoint(f"content: {baseline} - {FORMAT_ARM}", baseline, FORMAT_ARM, PRIMARY))
    if {baseline, SFT} <= have:
        out.append(Endpoint(f"content: {baseline} - {SFT}", baseline, SFT, SECONDARY))
    out += [Endpoint(f"content: {a} - {baseline}", a, baseline, EXPLORATORY)
            for a in algorithms if a != baseline and {a, baseline} <= have]
    return out


def _d(family: Family, a: str, b: str):
    _, ra, rb = paired(family, a, b)
    if not ra:
        raise ValueError(f"{a} and {b} share no seed: nothing to pair")
    return rate_SQ(ra, "content") - rate_SQ(rb, "content")


def decisions(family: Family, algorithms: tuple[str, ...], baseline: str, alpha: float, power: float,
              target: float) -> list[dict[str, Any]]:
    """Per endpoint: its seed-level paired t-test at alpha (one primary: no adjustment), the MDE with t quantiles
    from its per-seed sd, the seeds for an MDE of `target`, and the seeds for `power` at its own mean (the pilot's
    effect: what the confirmatory run is sized by)."""
    out = []
    for e in content_endpoints(family, algorithms, baseline):
        d = _d(family, e.a, e.b)
        test = st.seed_t_test(d, 1 - alpha)
        sd = float(d.mean(axis=1).std(ddof=1)) if d.shape[0] > 1 else float("nan")
        known = sd == sd
        out.append({"endpoint": e, "d": d, "test": test, "rejected": test.p <= alpha,
                    "mde": st.t_mde(sd, d.shape[0], alpha, power),
                    "seeds_for_target": st.seeds_needed(sd, target, alpha, power) if known else None,
                    "seeds_at_mean": st.seeds_needed(sd, test.mean, alpha, power) if known and test.mean else None})
    return out


def content_table(family: Family, algorithms: tuple[str, ...], baseline: str, alpha: float, power: float,
                  target: float) -> dict[str, Any]:
    rows = []
    for x in decisions(family, algorithms, baseline, alpha, power, target):
        e, t, d = x["endpoint"], x["test"], x["d"]
        call = st.verdict(t.mean, x["rejected"], x["mde"], target)
        rows.append([e.label, e.role, family.split, f"{d.shape[0]} x {d.shape[1]}", f"{t.mean:+.3f}",
                     f"[{t.low:+.3f}, {t.high:+.3f}]", f"{t.p:.2g}", f"{x['mde']:.3f}",
                     str(x["seeds_for_target"] or "> 500"), str(x["seeds_at_mean"] or "> 500"),
                     call if e.role == PRIMARY else f"{call} ({e.role}, unadjusted)"])
    return {"columns": ["endpoint", "role", "split", "seeds x questions", "mean", f"seed-level t interval "
                        f"({1 - alpha:.0%})", "seed t-test p", f"MDE (t, {power:.0%} power)",
                        f"seeds for MDE {target:g}", f"seeds for {power:.0%} power at this mean", "verdict"],
            "rows": rows}


def content_verdicts(family: Family, algorithms: tuple[str, ...], baseline: str, alpha: float, power: float,
                     target: float) -> list[str]:
    """One generated line per v2 endpoint (bench/learning_stats.py `verdict_line`)."""
    return [st.verdict_line(x["endpoint"].label, x["test"], x["test"].p, x["rejected"], x["mde"], target,
                            x["seeds_for_target"]) + ("" if x["endpoint"].role == PRIMARY
                                                      else f" ({x['endpoint'].role}, unadjusted)")
            for x in decisions(family, algorithms, baseline, alpha, power, target)]


def accuracy_table(family: Family) -> dict[str, Any]:
    """Per policy, mean over its seeds and the questions: content accuracy beside the format-strict accuracy (the
    user-facing metric) and the well-formed rate."""
    rows = []
    for policy in policies(family):
        runs = list(runs_of(family, policy).values())
        rows.append([policy, ", ".join(str(r.seed) for r in runs), f"{rate_SQ(runs, 'content').mean():.3f}",
                     f"{rate_SQ(runs).mean():.3f}", f"{rate_SQ(runs, 'formed').mean():.3f}"])
    return {"columns": ["policy", "seeds", "content accuracy", "format-strict accuracy", "well-formed"],
            "rows": rows}


# ---- the pilot's selection rule (docs/learning.md, written before the pilot runs) ---------------------------
@dataclass(frozen=True)
class PilotSetting:
    """One pilot setting's runs, task and format-only arms together: how many collapsed, whether the clip fraction
    stood above zero, and the per-seed sd of the content endpoint (task - format-only)."""
    name: str
    runs: int
    collapsed: int
    clip_active: bool
    content_sd: float


def choose_setting(settings: list[PilotSetting]) -> PilotSetting | None:
    """The rule: no run collapses; the clip fraction is above zero; then the smallest per-seed sd of the content
    endpoint (ties: the name, for a deterministic choice). None when no setting passes the first two."""
    eligible = [s for s in settings if s.collapsed == 0 and s.clip_active]
    return min(eligible, key=lambda s: (s.content_sd, s.name)) if eligible else None


def collapsed_runs(steps_table: dict[str, Any], family: Family) -> set[tuple[str, int]]:
    """(policy, seed) of the runs that collapsed: a collapse alarm in training (formed_but_wrong included: the
    record's `<family>-steps` table), or a content accuracy on the validation split below SFT's on the same seed."""
    col = {name: i for i, name in enumerate(steps_table["columns"])}
    out = {(row[col["algorithm"]], int(row[col["seed"]])) for row in steps_table["rows"]
           if any(name in COLLAPSE_ALARMS for name in str(row[col["alarms"]]).split(", "))}
    sft = runs_of(family, SFT)
    for policy in policies(family):
        for seed, run in runs_of(family, policy).items():
            if policy != SFT and seed in sft and run.content is not None and sft[seed].content is not None \
                    and run.content.mean() < sft[seed].content.mean():
                out.add((policy, seed))
    return out


def clip_active(steps_table: dict[str, Any]) -> bool:
    """The clip fraction above zero in at least half of all the runs' steps (the step size moves the policy)."""
    col = steps_table["columns"].index("clip frac")
    values = [row[col] for row in steps_table["rows"] if row[col] is not None]
    return bool(values) and sum(v > 0 for v in values) >= len(values) / 2


def pilot_setting(name: str, steps_table: dict[str, Any], family: Family, baseline: str) -> PilotSetting:
    """A pilot record's line for the rule, from its steps table and its per-question file."""
    d = _d(family, baseline, FORMAT_ARM)
    sd = float(d.mean(axis=1).std(ddof=1)) if d.shape[0] > 1 else float("inf")
    runs = sum(1 for run in family.runs.values() if run.policy != SFT)
    return PilotSetting(name, runs, len(collapsed_runs(steps_table, family)), clip_active(steps_table), sd)


def pilot_settings(records: list[str], family: str = "arith", baseline: str = "grpo") -> list[PilotSetting]:
    """The pilot's settings from their records (bench/results/<record>.json and its per-question file)."""
    from bench.results import RESULTS_DIR

    out = []
    for name in records:
        record = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        out.append(pilot_setting(name, record["tables"][f"{family}-steps"], read_per_question(name)[family], baseline))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="protocol v2's pilot: the setting its rule chooses")
    parser.add_argument("records", nargs="+", help="the pilot's records, e.g. learning-valid-v2-b8-lr1e-5")
    parser.add_argument("--family", default="arith")
    args = parser.parse_args(argv)
    settings = pilot_settings(args.records, args.family)
    for s in settings:
        print(f"{s.name}: {s.runs} runs, {s.collapsed} collapsed, clip fraction "
              f"{'above zero' if s.clip_active else 'at zero'}, per-seed sd of the primary {s.content_sd:.4f}")
    chosen = choose_setting(settings)
    print(f"chosen: {chosen.name}" if chosen else "no setting qualifies: no confirmatory run (docs/learning.md)")
    return 0 if chosen else 1


if __name__ == "__main__":
    raise SystemExit(main())
