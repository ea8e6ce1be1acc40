"""Tables, verdicts and the plot of bench/bench_learning.py (pure functions over the per-run results files).

Descriptive, not the protocol's verdicts (bench/learning_protocol.py). Intervals (bench/learning_stats.py): a run's
held-out accuracy has a percentile bootstrap interval over questions (stages.heldout); a run's gain over the SFT
policy has a *paired* bootstrap interval (`paired_gain`: the same questions resampled for both). Two algorithms are
compared with `unpaired_two_level_diff`: each draw resamples the questions (shared by both) and, independently per
algorithm, its seeds.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench.learning_baseline import steps_against_sft
from bench.learning_stats import paired_gain, unpaired_two_level_diff
from stages.core.algorithm_spec import SPECS

ALGOS = tuple(spec.name for spec in SPECS)   # the algorithm table, in its order
BASELINE = next(spec.name for spec in SPECS if not spec.branches)  # what the tree algorithms are compared with

EARLY_LATE = 3  # steps averaged for "early" (first) and "late" (last) training values
COLLAPSE_ALARMS = ("reward_at_floor", "reward_collapse", "formed_but_wrong", "entropy_collapse", "tool_collapse",
                   "nonfinite_loss")
ABOUT_HALF = (0.35, 0.65)  # the tool-call ratio range read as the paper's "about half"


def advantage_sign_agreement(rows: list[dict[str, Any]]) -> dict[str, float]:
    """From rollout dumps (one row per trajectory: step, group, reward.score, advantage): over groups whose rewards
    differ, the fraction of trajectories whose advantage has the sign of (reward - group mean), the check that would
    catch a flipped sign or a wrong group id; trajectories at the group mean are left out."""
    groups: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in rows:
        groups.setdefault((r["step"], r["group"]), []).append((float(r["reward"]["score"]), float(r["advantage"])))
    agree = total = 0
    for members in groups.values():
        scores = [score for score, _ in members]
        if max(scores) == min(scores):
            continue
        mean = statistics.fmean(scores)
        for score, adv in members:
            if score != mean:
                total += 1
                agree += (score > mean) == (adv > 0)
    return {"agreement": agree / total if total else float("nan"), "trajectories": float(total)}


def spread(values: list[float]) -> dict[str, float]:
    """Mean and range over seeds."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "range": max(values) - min(values)}


def early_late(rows: list[dict[str, Any]], key: str, k: int = EARLY_LATE) -> tuple[float, float]:
    """Mean of the first and of the last k steps; in a run shorter than 2k steps, of its halves (the middle step
    of an odd count in neither), so that "early -> late" never compares a window with itself."""
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    if not values:
        return float("nan"), float("nan")
    k = min(k, max(1, len(values) // 2))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def run_mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def collapse(run: dict[str, Any]) -> dict[str, Any] | None:
    """The first collapse alarm of a run ({name, step, message}), or None: reward at its floor or fallen from its
    best, entropy or tool use collapsed, a non-finite loss (stages/rl/alarms.py)."""
    hits = [a for a in run.get("alarms", []) if a["name"] in COLLAPSE_ALARMS]
    return min(hits, key=lambda a: a["step"]) if hits else None


def alarm_counts(run: dict[str, Any]) -> dict[str, int]:
    """Steps on which each alarm fired."""
    counts: dict[str, int] = {}
    for a in run.get("alarms", []):
        counts[a["name"]] = counts.get(a["name"], 0) + 1
    return counts


def algorithm_summary(runs: list[dict[str, Any]], sft: dict[str, Any]) -> dict[str, Any]:
    """One algorithm's seeds -> held-out accuracy spread, paired gains, training statistics (means over seeds)."""
    per_question(runs)  # the same questions for every seed, or a clear error
    out: dict[str, Any] = {**gain_summary([(r["seed"], sft_for(sft, r), r["correct_Q"]) for r in runs]),
        "seeds": [r["seed"] for r in runs], "accuracy": spread([r["heldout"]["accuracy"] for r in runs]),
        "accuracy_ci": [(r["heldout"]["ci_low"], r["heldout"]["ci_high"]) for r in runs],
        "heldout_tools": spread([r["heldout"]["tool_calls_per_traj"] for r in runs]),
        "heldout_format": spread([r["heldout"]["format_valid"] for r in runs]),
        "advantage_sign": spread([r.get("advantage_signs", {}).get("agreement", float("nan")) for r in runs]),
        "alarms": [alarm_counts(r) for r in runs],
        "collapsed": [(r["seed"], c) for r in runs if (c := collapse(r)) is not None],
    }
    for key in ("reward/mean", "accuracy", "reward/format_error_rate"):
        pairs = [early_late(r["steps"], key) for r in runs]
        out[f"{key}:early"] = spread([p[0] for p in pairs])
        out[f"{key}:late"] = spread([p[1] for p in pairs])
    for key in ("tools/calls_per_traj", "rollout/tool_calls_executed_per_traj", "rollout/branches_per_group",
                "entropy/mean", "reward/groups_without_signal", "reward/format_error_rate", "timing/step_s",
                "finish/length"):
        out[key] = spread([run_mean(r["steps"], key) for r in runs])
    return out


def gain_summary(pairs: list[tuple[int | None, list[float], list[float]]]) -> dict[str, Any]:
    """Gains over SFT from (seed, SFT's per-question accuracies to pair with, the run's): per run the paired gain
    over questions (`gain`, `gain_ci`), and the mean gain over seeds (`mean_gain`: each seed minus its own SFT
    evaluation, questions and seeds resampled). The record's descriptive cells are recomputed from the per-question
    file with it (bench/learning_record.py `descriptive_gain_cells`)."""
    gains = [paired_gain(sft_Q, rl_Q, seed=seed or 0) for seed, sft_Q, rl_Q in pairs]
    paired = np.array([np.asarray(rl_Q, dtype=float) - np.asarray(sft_Q, dtype=float) for _, sft_Q, rl_Q in pairs]).T
    mean, low, high = unpaired_two_level_diff(paired, np.zeros((paired.shape[0], 1)))
    return {"mean_gain": {"mean": mean, "low": low, "high": high}, "gain": spread([g[0] for g in gains]),
            "gain_ci": [(g[1], g[2]) for g in gains]}


def gain_cells(summary: dict[str, Any]) -> dict[str, str]:
    """The descriptive table's "gain vs SFT" and "mean gain [95%]" cells of one policy."""
    mg = summary["mean_gain"]
    return {"gain vs SFT": f"{summary['gain']['mean']:+.3f} ("
                           + ", ".join(f"{lo:+.2f}..{hi:+.2f}" for lo, hi in summary["gain_ci"]) + ")",
            "mean gain [95%]": f"{mg['mean']:+.3f} [{mg['low']:+.3f}, {mg['high']:+.3f}]"}


def sft_for(sft: dict[str, Any], run: dict[str, Any]) -> list[float]:
    """SFT's per-question accuracies to pair with `run`: SFT's evaluation with the run's own sampling seed (the
    protocol's pairing: run s and SFT's evaluation s share their samples' seed), else SFT's mean over its seeds."""
    return sft.get("correct_Q_by_seed", {}).get(run.get("eval_seed", run["seed"]), sft["correct_Q"])


def per_question(runs: list[dict[str, Any]]) -> np.ndarray:
    """[questions, seeds] held-out accuracies of one algorithm (checked to be the same questions)."""
    questions = runs[0]["questions"]
    for r in runs:
        if r["questions"] != questions:
            raise ValueError(f"{r['algorithm']} seed {r['seed']} was evaluated on other questions than seed "
                             f"{runs[0]['seed']}; rerun its held-out evaluation")
    return np.array([r["correct_Q"] for r in runs], dtype=float).T


def compare(by_algo: dict[str, list[dict[str, Any]]], algo: str, base: str = BASELINE) -> dict[str, Any] | None:
    """`algo` vs `base`: held-out accuracy difference with its two-level interval, tool-call ratios."""
    if algo not in by_algo or base not in by_algo:
        return None
    a, b = by_algo[algo], by_algo[base]
    diff, low, high = unpaired_two_level_diff(per_question(a), per_question(b))
    out: dict[str, Any] = {"diff": diff, "low": low, "high": high}
    for key, name in (("rollout/tool_calls_executed_per_traj", "train_exec"), ("tools/calls_per_traj", "train")):
        num, den = statistics.fmean(run_mean(r["steps"], key) for r in a), \
            statistics.fmean(run_mean(r["steps"], key) for r in b)
        out[name] = (num, den, num / den if den else float("nan"))
    num = statistics.fmean(r["heldout"]["tool_calls_per_traj"] for r in a)
    den = statistics.fmean(r["heldout"]["tool_calls_per_traj"] for r in b)
    out["eval"] = (num, den, num / den if den else float("nan"))
    return out


def claims_table(by_algo: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The papers' two claims as a table: each algorithm minus the baseline in held-out accuracy (two-level
    interval over questions and seeds), and its tool calls per trajectory relative to the baseline's."""
    rows = []
    for algo in (a for a in ALGOS if a != BASELINE):
        c = compare(by_algo, algo)
        if c is None:
            continue
        verdict = ("within noise" if c["low"] <= 0 <= c["high"]
                   else f"{algo} higher" if c["diff"] > 0 else f"{BASELINE} higher")
        (ta, tg, tr), (ea, eg, er) = c["train_exec"], c["eval"]
        rows.append([f"{algo} - {BASELINE}", f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]", verdict,
                     f"{ta:.2f} vs {tg:.2f} ({tr:.2f}x)", f"{ea:.2f} vs {eg:.2f} ({er:.2f}x)"])
    return {"columns": ["comparison", "held-out acc difference [95%]", "verdict",
                        "tool calls/traj executed in training", "tool calls/traj at evaluation"], "rows": rows}


def verdicts(summaries: dict[str, dict[str, Any]], sft: dict[str, Any],
             by_algo: dict[str, list[dict[str, Any]]] | None = None) -> list[str]:
    """Plain sentences: RL vs SFT per algorithm; the papers' two claims (accuracy, tool calls); collapses."""
    lines = []
    base = sft["heldout"]["accuracy"]
    for algo, s in summaries.items():
        acc, gain = s["accuracy"], s["gain"]
        beyond = gain["mean"] > acc["range"] and all(low > 0 for low, _ in s["gain_ci"])
        mg = s["mean_gain"]
        lines.append(f"{algo}: mean gain over SFT {mg['mean']:+.3f}, 95% interval over questions and seeds "
                     f"[{mg['low']:+.3f}, {mg['high']:+.3f}] -> "
                     + ("above SFT" if mg["low"] > 0 else "below SFT" if mg["high"] < 0 else
                        "not distinguishable from SFT (the interval holds 0)"))
        lines.append(f"{algo}: held-out accuracy {acc['mean']:.3f} (seeds {acc['min']:.3f}-{acc['max']:.3f}) vs SFT "
                     f"{base:.3f}; gain {gain['mean']:+.3f}, seed range {acc['range']:.3f}, paired 95% intervals "
                     + ", ".join(f"[{lo:+.3f}, {hi:+.3f}]" for lo, hi in s["gain_ci"]) + " -> "
                     + ("RL beats SFT beyond the seed-to-seed spread" if beyond else
                        "not distinguishable from SFT beyond the seed-to-seed spread"))
    signs = {algo: s["advantage_sign"]["min"] for algo, s in summaries.items()}
    lines.append("sanity: advantage sign = sign(reward - group mean) for "
                 + ", ".join(f"{algo} {value:.0%}" for algo, value in signs.items())
                 + " of the trajectories in groups with a reward signal (lowest seed)")
    base = BASELINE.upper()
    for algo in (a for a in ALGOS if a != BASELINE):
        c = compare(by_algo or {}, algo)
        if c is None:
            continue
        name = algo.upper()
        verdict = ("not distinguishable at this scale" if c["low"] <= 0 <= c["high"]
                   else f"{name} higher" if c["diff"] > 0 else f"{base} higher")
        lines.append(f"claim 1 ({name} more accurate than {base}): held-out accuracy {name} - {base} {c['diff']:+.3f}, "
                     f"95% interval over questions and seeds [{c['low']:+.3f}, {c['high']:+.3f}] -> {verdict}")
        (ta, tg, tr), (ea, eg, er) = c["train_exec"], c["eval"]
        half = ABOUT_HALF[0] <= tr <= ABOUT_HALF[1]
        lines.append(f"claim 2 ({name} needs about half the tool calls): executed per trajectory in training {name} "
                     f"{ta:.2f} vs {base} {tg:.2f} ({tr:.2f}x; carried, branches' copies included, "
                     f"{c['train'][2]:.2f}x); at evaluation, without branching, {ea:.2f} vs {eg:.2f} ({er:.2f}x) -> "
                     + ("about half in training" if half else f"not about half ({tr:.2f}x) in training"))
    for algo, s in summaries.items():
        for seed, alarm in s["collapsed"]:
            lines.append(f"collapse: {algo} seed {seed} -- alarm {alarm['name']} at step {alarm['step']}: "
                         f"{alarm['message']}")
    return lines


def _fmt(s: dict[str, float], digits: int = 3) -> str:
    return f"{s['mean']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def _alarm_text(counts: list[dict[str, int]]) -> str:
    names = sorted({n for c in counts for n in c})
    return ", ".join(f"{n} {sum(1 for c in counts if n in c)}/{len(counts)}" for n in names) or "none"


def table_rows(summaries: dict[str, dict[str, Any]], sft: dict[str, Any]) -> list[dict[str, str]]:
    """The printed / published table: one row for SFT, one per algorithm (mean [min, max] over seeds)."""
    h = sft["heldout"]
    rows = [{"policy": "SFT", "held-out acc": f"{h['accuracy']:.3f} ({h['ci_low']:.3f}-{h['ci_high']:.3f})",
             "gain vs SFT": "", "mean gain [95%]": "", "reward early -> late": "", "train acc early -> late": "",
             "tools/traj train (exec)": "", "tools/traj eval": f"{h['tool_calls_per_traj']:.2f}",
             "branches/group": "", "format err train": "", "format ok eval": f"{h['format_valid']:.2f}",
             "runs with alarms": "", "step s": ""}]
    for algo, s in summaries.items():
        rows.append({
            "policy": f"{algo} ({len(s['seeds'])} seeds)", "held-out acc": _fmt(s["accuracy"]), **gain_cells(s),
            "reward early -> late": f"{s['reward/mean:early']['mean']:.2f} -> {s['reward/mean:late']['mean']:.2f}",
            "train acc early -> late": f"{s['accuracy:early']['mean']:.2f} -> {s['accuracy:late']['mean']:.2f}",
            "tools/traj train (exec)": f"{s['tools/calls_per_traj']['mean']:.2f} "
                                       f"({s['rollout/tool_calls_executed_per_traj']['mean']:.2f})",
            "tools/traj eval": f"{s['heldout_tools']['mean']:.2f}",
            "branches/group": f"{s['rollout/branches_per_group']['mean']:.2f}",
            "format err train": f"{s['reward/format_error_rate:early']['mean']:.2f} -> "
                                f"{s['reward/format_error_rate:late']['mean']:.2f}",
            "format ok eval": f"{s['heldout_format']['mean']:.2f}",
            "runs with alarms": _alarm_text(s["alarms"]),
            "step s": f"{s['timing/step_s']['mean']:.0f}"})
    return rows


PANELS = (("reward/mean", "reward"), ("accuracy", "training accuracy (new prompts)"),
          ("entropy/mean", "token entropy / ln|V|"), ("rollout/tool_calls_executed_per_traj",
                                                       "tool calls executed / trajectory"),
          ("rollout/branches_per_group", "branches / group"), ("reward/format_error_rate", "format error rate"),
          ("response/length", "response tokens"))
COLORS = dict(zip(ALGOS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")))
TITLES = {"arith": "3-digit products, one <python> call", "chain": "search, then python on its result (2 calls)"}


def plot(results: dict[str, dict[str, Any]], sft: dict[str, Any], png: Path, family: str = "") -> Path:
    """Per-step curves (mean over seeds, band = seed range) and the held-out accuracy per run with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    by_algo = _by_algo(results)
    for ax, (key, title) in zip(axes.flat, PANELS):
        for algo, runs in by_algo.items():
            steps = sorted({row["step"] for run in runs for row in run["steps"]})
            grid = np.array([[next((float(x[key]) for x in run["steps"] if x["step"] == s and x.get(key) is not None),
                                   np.nan) for s in steps] for run in runs])
            ax.plot(steps, np.nanmean(grid, axis=0), color=COLORS.get(algo), label=algo, marker=".")
            ax.fill_between(steps, np.nanmin(grid, axis=0), np.nanmax(grid, axis=0), color=COLORS.get(algo), alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    _accuracy_panel(axes.flat[7], by_algo, sft)
    names = " vs ".join(a.upper() for a in by_algo)
    fig.suptitle(f"{names} from one SFT policy (SmolLM2-135M; {family}: {TITLES.get(family, family)}; "
                 "band = seed range)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=72)
    plt.close(fig)
    return png


def _by_algo(results: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_algo: dict[str, list[dict[str, Any]]] = {}
    for r in results.values():
        if r["algorithm"] != "sft":
            by_algo.setdefault(r["algorithm"], []).append(r)
    return {algo: sorted(runs, key=lambda r: r["seed"]) for algo, runs in by_algo.items()}


def _accuracy_panel(ax, by_algo: dict[str, list[dict[str, Any]]], sft: dict[str, Any]) -> None:
    h = sft["heldout"]
    ax.axhspan(h["ci_low"], h["ci_high"], color="grey", alpha=0.2)
    ax.axhline(h["accuracy"], color="grey", label=f"SFT {h['accuracy']:.2f}")
    ticks, labels, x = [], [], 0.0
    for algo, runs in by_algo.items():
        for run in runs:
            e = run["heldout"]
            marker = "x" if collapse(run) else "o"
            ax.errorbar([x], [e["accuracy"]], yerr=[[e["accuracy"] - e["ci_low"]], [e["ci_high"] - e["accuracy"]]],
                        fmt=marker, color=COLORS.get(algo), capsize=3)
            ticks.append(x)
            labels.append(f"{algo}\ns{run['seed']}")
            x += 1
        x += 0.5
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_title("held-out accuracy after RL (95% bootstrap; x = collapse alarm)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def report(results: dict[str, dict[str, Any]], timing: dict[str, Any], root: Path, missing: list[str],
           family: str = "", name: str | None = None, baselines: list[dict[str, Any]] | None = None) -> Path | None:
    """Print the table and verdicts, write summary-<name>.json and learning-<name>.png (name: the family, or
    family@tag for a variant), publish them. `baselines`: the SFT policy on each step's prompts, one per seed."""
    from tabulate import tabulate

    from stages.core.atomic import write_json

    sft = results.get("sft")
    name = name or family
    print(f"\n=== task family {name}: {TITLES.get(family, '')} ===")
    if sft is None:
        print("no SFT evaluation yet; nothing to report")
        return None
    by_algo = _by_algo(results)
    summaries = {algo: algorithm_summary(runs, sft) for algo, runs in by_algo.items()}
    for algo, s in summaries.items():  # CPU of every attempt (RL + its held-out evaluation), per run
        cpu = [a["cpu_s"] for a in timing.get("attempts", []) if a["kind"] == algo]
        s["cpu_min_per_run"] = sum(cpu) / 60 / max(1, len(s["seeds"]))
    rows = table_rows(summaries, sft)
    lines = verdicts(summaries, sft, by_algo)
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print("\n" + "\n".join(lines))
    steps_vs_sft = steps_against_sft(by_algo, baselines or [])
    if steps_vs_sft["rows"]:
        print("\nper step, mean over seeds: the SFT policy on that step's own prompts vs each algorithm's rollouts")
        print(tabulate(steps_vs_sft["rows"], headers=steps_vs_sft["columns"], tablefmt="github"))
    print("\n" + timing_text(timing))
    png = plot(results, sft, root / f"learning-{name}.png", name) if by_algo else None
    write_json(root / f"summary-{name}.json", {"summaries": summaries, "verdicts": lines, "table": rows,
                                               "steps_vs_sft": steps_vs_sft, "claims": claims_table(by_algo),
                                               "timing": timing, "missing": missing})
    _publish(name, rows, lines, png)
    return png


STEP_COLUMNS = (("reward/mean", "reward"), ("accuracy", "acc"), ("reward/format_error_rate", "format err"),
                ("tools/calls_per_traj", "tools/traj"), ("finish/length", "cut at cap"),
                ("rollout/logp_mismatch", "logp mismatch"), ("ppo_kl", "ppo_kl"), ("clip_fraction", "clip frac"),
                ("grad_norm", "grad norm"))


def step_table(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's every step (bench/results/learning*.json): the rows a reader checks a run's steps with."""
    rows = []
    for run in sorted(runs, key=lambda r: (r["algorithm"], r["seed"])):
        fired: dict[int, list[str]] = {}
        for alarm in run.get("alarms", []):
            fired.setdefault(int(alarm["step"]), []).append(alarm["name"])
        for row in run["steps"]:
            rows.append([run["algorithm"], run["seed"], row["step"]]
                        + [_num(row.get(key)) for key, _ in STEP_COLUMNS] + [", ".join(fired.get(row["step"], []))])
    return {"columns": ["algorithm", "seed", "step", *[label for _, label in STEP_COLUMNS], "alarms"], "rows": rows}


def _num(value: Any) -> float | None:
    return None if value is None else float(f"{float(value):.4g}")


def timing_text(timing: dict[str, Any]) -> str:
    """Wall and CPU time: a single-threaded run's CPU seconds are what it would take alone on an idle core."""
    runs = [a for a in timing.get("attempts", []) if a["job"] != "sft"]
    cpu = sum(a["cpu_s"] for a in runs)
    wall = max((a["wall_s"] for a in runs), default=0.0)
    sft = timing.get("sft", {})
    train = sft.get("train_runtime_s")
    return (f"time: data + SFT when first built {sft.get('wall_s', 0) / 60:.1f} min wall, "
            f"{sft.get('cpu_s', 0) / 60:.1f} min CPU (LLaMA-Factory train_runtime {(train or 0) / 60:.1f} min); "
            f"RL+eval runs {len(runs)} attempts, {cpu / 60:.1f} min CPU in all, longest attempt {wall / 60:.1f} min "
            f"wall; idle-box estimate with 2 runs at a time: {(sft.get('cpu_s', 0) / 2 + cpu / 2) / 60:.0f} min")


def _publish(family: str, rows: list[dict[str, str]], lines: list[str], png: Path | None) -> None:
    from tasks.artifacts import publish_image, publish_markdown, publish_table

    publish_table(f"bench-learning-{family}", rows, f"{family}: {' vs '.join(a.upper() for a in ALGOS)} from one SFT policy")
    publish_markdown(f"bench-learning-{family}-verdicts", "\n".join(f"- {line}" for line in lines))
    if png is not None:
        publish_image(f"bench-learning-{family}-curves", png, f"{family}: per-step curves and held-out accuracy")
