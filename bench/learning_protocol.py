"""The learning bench's protocols (docs/learning.md), as tables computed from a record's per-question file alone:
rerunning it from the repository reproduces every interval (the bootstrap is seeded by the design).

Protocol v1 (issue 44, corrected in issue 54): primary endpoints (the primary family, Holm at alpha over them): E1
each algorithm - SFT, then each tree algorithm - the baseline (E2 ARPO - GRPO, E3 AEPO - GRPO), each decided by the
seed-level paired t-test (the two-level bootstrap beside it is descriptive: at 5 seeds it rejects a true null far
more often than its level). Every other family is an exploratory arm: the same endpoints, unadjusted, and said so.
Secondary endpoints (unadjusted): accuracy among well-formed answers (per seed, averaged over seeds), the well-formed
rate, executed tool calls per question. Control: the lr = 0 run - SFT must hold 0. Protocol v2 (content accuracy,
the format-only arm): bench/learning_content.py, its tables added where the runs were graded for content.

    .venv/bin/python -m bench.learning_protocol <record>   # e.g. learning: bench/results/per-question/learning.json
    .venv/bin/python -m bench.learning_protocol <record> --regenerate   # its record's generated tables, rewritten
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import learning_content as lc
from bench import learning_stats as st
from bench.learning_questions import (
    PER_QUESTION_DIR,
    SFT,
    Family,
    count_SQ,
    paired,
    policies,
    rate_SQ,
    read_per_question,
    runs_of,
)
from stages.core.algorithm_spec import SPECS

CONTROL = "control"


@dataclass(frozen=True)
class Design:
    """What the protocol fixes before the confirmatory run."""
    alpha: float = 0.05
    target_mde: float = 0.07          # the pre-registered smallest difference worth finding at `power`
    power: float = 0.8
    primary_family: str = "arith"     # Holm over its primaries; the other families are exploratory
    algorithms: tuple[str, ...] = tuple(spec.name for spec in SPECS)
    baseline: str = next(spec.name for spec in SPECS if not spec.branches)   # GRPO: independent samples
    bootstrap_samples: int = st.BOOTSTRAP_SAMPLES
    bootstrap_seed: int = 0
    seeds_options: tuple[int, ...] = (3, 4, 5, 6, 8, 10, 12, 16, 20)
    planned_samples: int = 1          # samples per question of the confirmatory run's evaluation
    planned_questions: int = 400      # its test questions per family
    plan_as_primary: str = ""         # a pilot's family (validation split: no claims) planned at the primaries' level
    question_options: tuple[int, ...] = (80, 200, 400, 800, 1600)


def _p(p: float) -> str:
    return "n/a" if math.isnan(p) else f"{p:.4f}" if p >= 1e-3 else f"{p:.1e}"


def _ci(e: st.Estimate) -> str:
    return f"[{e.low:+.3f}, {e.high:+.3f}] ({100 * e.confidence:.4g}%)"


def _boot(d: np.ndarray, design: Design, confidence: float = 0.95) -> st.Estimate:
    return st.two_level_bootstrap(d, design.bootstrap_samples, design.bootstrap_seed, confidence)


def primary_pairs(family: Family, design: Design) -> list[tuple[str, str, str]]:
    """(name, a, b) of the primary endpoints the family's runs allow: E1 per algorithm, then each other algorithm
    against the baseline (E2, E3, ...)."""
    have = set(policies(family))
    algos = [a for a in design.algorithms if a in have]
    out = [(f"E1 {a} - {SFT}", a, SFT) for a in algos if SFT in have]
    others = [a for a in algos if a != design.baseline and design.baseline in have]
    return out + [(f"E{i} {a} - {design.baseline}", a, design.baseline) for i, a in enumerate(others, start=2)]


def _diff(family: Family, a: str, b: str, field: str = "correct") -> np.ndarray:
    _, ra, rb = paired(family, a, b)
    if not ra:
        raise ValueError(f"{a} and {b} share no seed: nothing to pair")
    return rate_SQ(ra, field) - rate_SQ(rb, field)


def _seed_sd(d: np.ndarray) -> float:
    """The sd of the per-seed mean differences (nan with one seed)."""
    m = d.mean(axis=1)
    return float(m.std(ddof=1)) if m.size > 1 else math.nan


def decide(d: np.ndarray, level: float, design: Design) -> tuple[st.SeedTest, float, int | None]:
    """The seed-level decision of one endpoint at `level`: its t-test with the interval at 1 - level, its MDE (t
    quantiles, per-seed sd, `design.power`) and the seeds that would give the target's MDE."""
    sd = _seed_sd(d)
    seeds = None if math.isnan(sd) else st.seeds_needed(sd, design.target_mde, level, design.power)
    return st.seed_t_test(d, 1 - level), st.t_mde(sd, d.shape[0], level, design.power), seeds


def _holm(tests: dict[str, st.SeedTest], alpha: float) -> dict[str, st.HolmResult]:
    return st.holm({label: 1.0 if math.isnan(t.p) else t.p for label, t in tests.items()}, alpha)


def primary_endpoints(name: str, family: Family, design: Design) -> list[dict[str, Any]]:
    """Per primary endpoint, decided by the seed-level paired t-test (Holm over the family's primaries when it is
    the primary family): label, d, its test at the Holm-stepped level, adjusted p, rejection, MDE, seeds needed.
    Under protocol v2 (runs graded for content) v1's endpoints are exploratory: content accuracy is the primary."""
    confirmatory = name == design.primary_family and not lc.has_content(family)
    diffs = {label: _diff(family, a, b) for label, a, b in primary_pairs(family, design)}
    adjusted = _holm({label: st.seed_t_test(d) for label, d in diffs.items()}, design.alpha) if confirmatory else {}
    out = []
    for label, d in diffs.items():
        h = adjusted.get(label)
        level = h.level if h else design.alpha
        test, mde, seeds = decide(d, level, design)
        out.append({"label": label, "d": d, "test": test, "level": level, "adjusted": h.adjusted if h else math.nan,
                    "rejected": h.rejected if h else test.p <= design.alpha, "mde": mde, "seeds": seeds,
                    "exploratory": not confirmatory})
    return out


def primary_table(name: str, family: Family, design: Design) -> dict[str, Any]:
    """Per primary endpoint: mean, seed-level t interval at its Holm step's level, t-test p, Holm p, the two-level
    bootstrap p (descriptive: anti-conservative at 5 seeds), the MDE (t quantiles), the seeds for the target MDE and
    the verdict."""
    rows = []
    for e in primary_endpoints(name, family, design):
        t, d = e["test"], e["d"]
        call = st.verdict(t.mean, e["rejected"], e["mde"], design.target_mde)
        rows.append([e["label"], family.split, f"{d.shape[0]} x {d.shape[1]}", f"{t.mean:+.3f}",
                     f"[{t.low:+.3f}, {t.high:+.3f}] ({100 * (1 - e['level']):.4g}%)", _p(t.p),
                     "unadjusted (exploratory)" if e["exploratory"] else _p(e["adjusted"]), _p(_boot(d, design).p),
                     f"{e['mde']:.3f}", str(e["seeds"] or "> 500"),
                     f"{call} (exploratory, unadjusted)" if e["exploratory"] else call])
    return {"columns": ["endpoint", "split", "seeds x questions", "mean", "seed-level t interval (Holm-stepped level)",
                        "seed t-test p", "Holm p", "two-level bootstrap p (descriptive)",
                        f"MDE (t, {design.power:.0%} power)", f"seeds for MDE {design.target_mde:g}", "verdict"],
            "rows": rows}


def formed_line(family: Family, a: str, design: Design) -> str | None:
    """The secondary "accuracy among well-formed answers" (per-seed ratio, averaged over seeds) of `a` - SFT as one
    line: a reasoning gain is shown, reversed, or not shown with the largest gain its interval leaves open."""
    _, ra, rb = paired(family, a, SFT)
    if not ra:
        return None
    (ca, fa), (cb, fb) = [(count_SQ(r, "correct"), count_SQ(r, "formed")) for r in (ra, rb)]
    e = st.ratio_bootstrap(ca, fa, cb, fb, design.bootstrap_samples, design.bootstrap_seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_seed = ca.sum(1) / fa.sum(1) - cb.sum(1) / fb.sum(1)
    t = st.seed_t_test(per_seed[:, None])
    if e.low > 0:
        reading = "a reasoning gain is shown"
    elif e.high < 0:
        reading = "reversed: fewer well-formed answers are right"
    else:
        reading = f"a reasoning gain is not shown; gains up to {e.high:+.3f} are not excluded"
    return (f"accuracy among well-formed answers, {a} - {SFT}: {e.mean:+.3f} [{e.low:+.3f}, {e.high:+.3f}] "
            f"({e.confidence:.0%} two-level bootstrap; seed-level t interval [{t.low:+.3f}, {t.high:+.3f}]) -> {reading}")


def verdict_table(name: str, family: Family, design: Design) -> dict[str, Any]:
    """The verdicts as generated lines: protocol v2's content endpoints first where the runs were graded for content
    (bench/learning_content.py), then v1's primaries and each algorithm's accuracy among well-formed answers."""
    lines = lc.content_verdicts(family, design.algorithms, design.baseline, design.alpha, design.power,
                                design.target_mde) if lc.has_content(family) else []
    lines += [st.verdict_line(e["label"], e["test"], e["adjusted"], e["rejected"], e["mde"], design.target_mde,
                             e["seeds"]) + (" (exploratory, unadjusted)" if e["exploratory"] else "")
             for e in primary_endpoints(name, family, design)]
    lines += [line for _, a, b in primary_pairs(family, design) if b == SFT
              if (line := formed_line(family, a, design)) is not None]
    return {"columns": ["verdict"], "rows": [[line] for line in lines]}


def _secondary_rows(family: Family, a: str, b: str, design: Design) -> list[list[str]]:
    _, ra, rb = paired(family, a, b)
    if not ra:
        return []
    rows = []
    if b == SFT:
        (ca, fa), (cb, fb) = [(count_SQ(r, "correct"), count_SQ(r, "formed")) for r in (ra, rb)]
        ratio = st.ratio_bootstrap(ca, fa, cb, fb, design.bootstrap_samples, design.bootstrap_seed)
        rows.append([f"accuracy among well-formed: {a} - {b}", f"{st.seed_mean_ratio(ca, fa):.3f}",
                     f"{st.seed_mean_ratio(cb, fb):.3f}", f"{ratio.mean:+.3f} {_ci(ratio)}", _p(ratio.p)])
        formed = _boot(rate_SQ(ra, "formed") - rate_SQ(rb, "formed"), design)
        rows.append([f"well-formed rate: {a} - {b}", f"{rate_SQ(ra, 'formed').mean():.3f}",
                     f"{rate_SQ(rb, 'formed').mean():.3f}", f"{formed.mean:+.3f} {_ci(formed)}", _p(formed.p)])
    ca, cb = rate_SQ(ra, "calls"), rate_SQ(rb, "calls")
    calls = _boot(ca - cb, design)
    ratio_text = f" ({ca.mean() / cb.mean():.2f}x)" if cb.mean() else ""
    rows.append([f"tool calls per question: {a} vs {b}", f"{ca.mean():.2f}{ratio_text}", f"{cb.mean():.2f}",
                 f"{calls.mean:+.3f} {_ci(calls)}", _p(calls.p)])
    return rows


def secondary_table(family: Family, design: Design) -> dict[str, Any]:
    """Unadjusted: accuracy among well-formed answers and the well-formed rate (RL - SFT), tool calls per question
    (RL vs SFT, each other algorithm vs the baseline)."""
    rows = []
    for _, a, b in primary_pairs(family, design):
        rows += _secondary_rows(family, a, b, design)
    return {"columns": ["endpoint (unadjusted)", "policy", "against", "difference [95%]", "bootstrap p"],
            "rows": rows}


def control_table(family: Family, design: Design) -> dict[str, Any] | None:
    """The lr = 0 control - SFT: the save -> reload -> evaluate path alone; its interval must hold 0."""
    if CONTROL not in policies(family) or SFT not in policies(family):
        return None
    d = _diff(family, CONTROL, SFT)
    e = _boot(d, design)
    call = ("holds 0: the path leaves the policy as SFT" if e.low <= 0 <= e.high
            else "excludes 0: the save -> reload -> evaluate path changes the policy; no RL gain can be read")
    return {"columns": ["endpoint", "seeds x questions", "difference [95%]", "bootstrap p", "verdict"],
            "rows": [[f"{CONTROL} - {SFT}", f"{d.shape[0]} x {d.shape[1]}", f"{e.mean:+.3f} {_ci(e)}", _p(e.p),
                      call]]}


def design_table(name: str, family: Family, design: Design) -> dict[str, Any]:
    """Per primary endpoint: this run's variance components, converted to `design.planned_samples` samples per
    question (the sampling part of the residual scales as 1/k), and the cheapest design whose MDE meets the target,
    at the first Holm step's level alpha/m in the primary family (every endpoint's level is unknown before the run,
    so the smallest is planned for), alpha in an exploratory one. A pilot of the baseline alone (a step-size sweep)
    also plans the comparisons between algorithms: their seed variance is twice the baseline's against SFT (two
    trained policies, each with its seed-to-seed spread, against one that only resamples)."""
    pairs = primary_pairs(family, design)
    m = 2 * len(design.algorithms) - 1  # the primaries: E1 per algorithm, each other algorithm vs the baseline
    primary = name in (design.primary_family, design.plan_as_primary)
    level = design.alpha / m if primary else design.alpha
    rows = []
    for label, a, b in pairs:
        d = _diff(family, a, b)
        if min(d.shape) < 2:
            continue
        _, ra, rb = paired(family, a, b)
        c = st.variance_components(d)
        k = ra[0].samples
        if k >= 2 and k != design.planned_samples:
            noise = sum(st.sampling_variance(count_SQ(r, "correct"), k) for r in (ra, rb))
            c = st.at_samples(c, noise, k, design.planned_samples)
        rows.append(_design_row(label, d.shape, c, level, design))
        if b == SFT and a == design.baseline and not any(x != SFT and y == a for _, x, y in pairs):
            twice = st.Components(2 * c.seed, c.question, c.residual)
            rows.append(_design_row("E2, E3 (planned: seed variance x2)", d.shape, twice, level, design))
    return {"columns": ["endpoint", "seeds x questions (this run)", "var seed", "var question",
                        f"var residual at {design.planned_samples} sample(s)", f"MDE at {design.planned_questions} "
                        f"questions, alpha {level:.3g}, by seeds", f"cheapest design for MDE <= {design.target_mde:g}",
                        "its MDE"], "rows": rows}


def _design_row(label: str, shape: tuple[int, int], c: st.Components, level: float, design: Design) -> list[str]:
    grid = st.design_grid(c, list(design.seeds_options), list(design.question_options), level, design.target_mde,
                          design.power)
    by_seeds = ", ".join(f"{S}: {st.mde(st.se_of_mean(c, S, design.planned_questions), level, design.power, S - 1):.3f}"
                         for S in (3, 4, 5, 6, 8))
    best = grid["best"]
    return [label, f"{shape[0]} x {shape[1]}", f"{c.seed:.2e}", f"{c.question:.2e}", f"{c.residual:.2e}", by_seeds,
            f"{best['seeds']} x {best['questions']}" if best else "none in the grid",
            f"{best['mde']:.3f}" if best else ""]


def policy_table(family: Family) -> dict[str, Any]:
    """Per policy, pooled over its seeds: accuracy, the well-formed rate, accuracy among well-formed answers (what a
    policy gets right when it answers in form: format repair moves the rate, reasoning this ratio), tool calls."""
    rows = []
    for policy in policies(family):
        runs = list(runs_of(family, policy).values())
        correct, formed = count_SQ(runs, "correct"), count_SQ(runs, "formed")
        rows.append([policy, ", ".join(str(s) for s in runs_of(family, policy)), f"{runs[0].samples}",
                     f"{rate_SQ(runs).mean():.3f}", f"{rate_SQ(runs, 'formed').mean():.3f}",
                     f"{st.seed_mean_ratio(correct, formed):.3f}", f"{rate_SQ(runs, 'calls').mean():.2f}"])
    return {"columns": ["policy", "seeds", "samples per question", "accuracy", "well-formed", "accuracy among "
                        "well-formed", "tool calls per sample"], "rows": rows}


def protocol_tables(per_question: dict[str, Family], design: Design = Design()) -> dict[str, dict[str, Any]]:
    """Every family's protocol tables, named `<family>-policies|primary|secondary|control|design` as a record holds
    them."""
    tables: dict[str, dict[str, Any]] = {}
    for name, family in per_question.items():
        tables[f"{name}-policies"] = policy_table(family)
        tables[f"{name}-primary"] = primary_table(name, family, design)
        tables[f"{name}-secondary"] = secondary_table(family, design)
        control = control_table(family, design)
        if control:
            tables[f"{name}-control"] = control
        tables[f"{name}-design"] = design_table(name, family, design)
        if lc.has_content(family):
            tables[f"{name}-content"] = lc.content_table(family, design.algorithms, design.baseline, design.alpha,
                                                         design.power, design.target_mde)
            tables[f"{name}-content-policies"] = lc.accuracy_table(family)
        tables[f"{name}-verdicts"] = verdict_table(name, family, design)
    return tables


def markdown(table: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in table["rows"]])


def design_for(split: str) -> Design:
    """The protocol's design for a record on `split`: the test split's carries the claims; a validation record (a
    choice of setting) claims nothing (no Holm family) and plans the primary family's confirmatory run."""
    return Design() if split == "eval_test" else Design(primary_family="", plan_as_primary=Design.primary_family)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the learning bench's protocol tables from a per-question file")
    parser.add_argument("record", help="the record's name, e.g. learning (bench/results/per-question/<record>.json)")
    parser.add_argument("--root", default=str(PER_QUESTION_DIR))
    parser.add_argument("--alpha", type=float, default=Design.alpha)
    parser.add_argument("--target-mde", type=float, default=Design.target_mde)
    parser.add_argument("--primary-family", default=None, help="default: the protocol's (none on the validation split)")
    parser.add_argument("--regenerate", action="store_true",
                        help="rewrite the tables the code generates in bench/results/<record>.json from its per-question "
                             "file (bench/learning_record.py regenerate_tables), then run python -m bench.results "
                             "--write-docs")
    args = parser.parse_args(argv)
    if args.regenerate:
        from bench.learning_record import regenerate_tables

        print(f"rewritten: {regenerate_tables(args.record)}")
        return 0
    try:
        per_question = read_per_question(args.record, Path(args.root))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    splits = {family.split for family in per_question.values()}
    design = replace(design_for(splits.pop() if len(splits) == 1 else "eval_test"), alpha=args.alpha,
                     target_mde=args.target_mde)
    if args.primary_family is not None:
        design = replace(design, primary_family=args.primary_family)
    for name, table in protocol_tables(per_question, design).items():
        print(f"\n## {name}\n\n{markdown(table)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
