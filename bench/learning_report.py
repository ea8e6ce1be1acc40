"""Tables, verdicts and the plot of bench/bench_learning.py (pure functions over the per-run results files).

Intervals: a run's held-out accuracy has a percentile bootstrap interval over questions (stages.heldout);
a run's gain over the SFT policy has a *paired* bootstrap interval (the same questions resampled for both, so
question difficulty cancels); across seeds we show the mean and the range [min, max], and call an effect real only
when the mean gain exceeds the seed-to-seed range of the RL accuracies and every seed's paired interval is above 0.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

EARLY_LATE = 3  # steps averaged for "early" (first) and "late" (last) training values


def paired_gain(sft_Q: list[float], rl_Q: list[float], samples: int = 2000, seed: int = 0,
                confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean of rl - sft, low, high): percentile bootstrap over questions, both policies resampled together."""
    sft, rl = np.asarray(sft_Q, dtype=float), np.asarray(rl_Q, dtype=float)
    if sft.shape != rl.shape or sft.size == 0:
        raise ValueError(f"paired gain needs the same questions for both policies, got {sft.shape} and {rl.shape}")
    diff = rl - sft
    index = np.random.default_rng(seed).integers(0, diff.size, size=(samples, diff.size))
    tail = (1 - confidence) / 2
    low, high = np.quantile(diff[index].mean(axis=1), [tail, 1 - tail])
    return float(diff.mean()), float(low), float(high)


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
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def run_mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def algorithm_summary(runs: list[dict[str, Any]], sft: dict[str, Any]) -> dict[str, Any]:
    """One algorithm's seeds -> held-out accuracy spread, paired gains, training statistics (means over seeds)."""
    gains = [paired_gain(sft["correct_Q"], r["correct_Q"], seed=r["seed"] or 0) for r in runs]
    out: dict[str, Any] = {
        "seeds": [r["seed"] for r in runs], "accuracy": spread([r["heldout"]["accuracy"] for r in runs]),
        "accuracy_ci": [(r["heldout"]["ci_low"], r["heldout"]["ci_high"]) for r in runs],
        "gain": spread([g[0] for g in gains]), "gain_ci": [(g[1], g[2]) for g in gains],
        "heldout_tools": spread([r["heldout"]["tool_calls_per_traj"] for r in runs]),
        "heldout_format": spread([r["heldout"]["format_valid"] for r in runs]),
        "advantage_sign": spread([r.get("advantage_signs", {}).get("agreement", float("nan")) for r in runs]),
    }
    for key in ("reward/mean", "accuracy"):
        pairs = [early_late(r["steps"], key) for r in runs]
        out[f"{key}:early"] = spread([p[0] for p in pairs])
        out[f"{key}:late"] = spread([p[1] for p in pairs])
    for key in ("tools/calls_per_traj", "rollout/tool_calls_executed_per_traj", "rollout/branches_per_group",
                "entropy/mean", "reward/groups_without_signal", "timing/step_s"):
        out[key] = spread([run_mean(r["steps"], key) for r in runs])
    return out


def verdicts(summaries: dict[str, dict[str, Any]], sft: dict[str, Any]) -> list[str]:
    """Plain sentences: which algorithms beat SFT beyond the seed spread; ARPO vs GRPO on accuracy and tools."""
    lines = []
    base = sft["heldout"]["accuracy"]
    for algo, s in summaries.items():
        acc, gain = s["accuracy"], s["gain"]
        beyond = gain["mean"] > acc["range"] and all(low > 0 for low, _ in s["gain_ci"])
        lines.append(f"{algo}: held-out accuracy {acc['mean']:.3f} (seeds {acc['min']:.3f}-{acc['max']:.3f}) vs SFT "
                     f"{base:.3f}; gain {gain['mean']:+.3f}, seed range {acc['range']:.3f}, paired 95% intervals "
                     + ", ".join(f"[{lo:+.3f}, {hi:+.3f}]" for lo, hi in s["gain_ci"]) + " -> "
                     + ("RL beats SFT beyond the seed-to-seed spread" if beyond else
                        "not distinguishable from SFT beyond the seed-to-seed spread"))
    signs = {algo: s["advantage_sign"]["min"] for algo, s in summaries.items()}
    lines.append("sanity: advantage sign = sign(reward - group mean) for "
                 + ", ".join(f"{algo} {value:.0%}" for algo, value in signs.items())
                 + " of the trajectories in groups with a reward signal (lowest seed)")
    if "arpo" in summaries and "grpo" in summaries:
        a, g = summaries["arpo"], summaries["grpo"]
        diff = a["accuracy"]["mean"] - g["accuracy"]["mean"]
        noise = max(a["accuracy"]["range"], g["accuracy"]["range"])
        lines.append(f"ARPO - GRPO held-out accuracy {diff:+.3f} (largest seed range {noise:.3f}): "
                     + ("within noise" if abs(diff) <= noise else ("ARPO higher" if diff > 0 else "GRPO higher")))
        key = "rollout/tool_calls_executed_per_traj"
        ratio = a[key]["mean"] / g[key]["mean"] if g[key]["mean"] else float("nan")
        lines.append(f"tool calls executed per trajectory in training: ARPO {a[key]['mean']:.2f} vs GRPO "
                     f"{g[key]['mean']:.2f} ({ratio:.2f}x); carried per trajectory {a['tools/calls_per_traj']['mean']:.2f}"
                     f" vs {g['tools/calls_per_traj']['mean']:.2f}; at evaluation ARPO {a['heldout_tools']['mean']:.2f} "
                     f"vs GRPO {g['heldout_tools']['mean']:.2f}")
    return lines


def _fmt(s: dict[str, float], digits: int = 3) -> str:
    return f"{s['mean']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def table_rows(summaries: dict[str, dict[str, Any]], sft: dict[str, Any]) -> list[dict[str, str]]:
    """The printed / published table: one row for SFT, one per algorithm (mean [min, max] over seeds)."""
    h = sft["heldout"]
    rows = [{"policy": "SFT", "held-out acc": f"{h['accuracy']:.3f} ({h['ci_low']:.3f}-{h['ci_high']:.3f})",
             "gain vs SFT": "", "reward early -> late": "", "train acc early -> late": "",
             "tools/traj (exec)": "", "eval tools/traj": f"{h['tool_calls_per_traj']:.2f}", "branches/group": "",
             "entropy": "", "no-signal groups": "", "step s": "", "CPU min/run": ""}]
    for algo, s in summaries.items():
        rows.append({
            "policy": f"{algo} ({len(s['seeds'])} seeds)", "held-out acc": _fmt(s["accuracy"]),
            "gain vs SFT": f"{s['gain']['mean']:+.3f} ("
                           + ", ".join(f"{lo:+.2f}..{hi:+.2f}" for lo, hi in s["gain_ci"]) + ")",
            "reward early -> late": f"{s['reward/mean:early']['mean']:.2f} -> {s['reward/mean:late']['mean']:.2f}",
            "train acc early -> late": f"{s['accuracy:early']['mean']:.2f} -> {s['accuracy:late']['mean']:.2f}",
            "tools/traj (exec)": f"{s['tools/calls_per_traj']['mean']:.2f} "
                                 f"({s['rollout/tool_calls_executed_per_traj']['mean']:.2f})",
            "eval tools/traj": f"{s['heldout_tools']['mean']:.2f}",
            "branches/group": f"{s['rollout/branches_per_group']['mean']:.2f}",
            "entropy": f"{s['entropy/mean']['mean']:.4f}",
            "no-signal groups": f"{s['reward/groups_without_signal']['mean']:.2f}",
            "step s": f"{s['timing/step_s']['mean']:.0f}",
            "CPU min/run": f"{s['cpu_min_per_run']:.1f}" if "cpu_min_per_run" in s else ""})
    return rows


PANELS = (("reward/mean", "reward"), ("accuracy", "training accuracy (new prompts)"),
          ("entropy/mean", "token entropy / ln|V|"), ("rollout/tool_calls_executed_per_traj",
                                                       "tool calls executed / trajectory"),
          ("rollout/branches_per_group", "branches / group"))
COLORS = {"grpo": "tab:blue", "arpo": "tab:orange", "aepo": "tab:green"}


def plot(results: dict[str, dict[str, Any]], sft: dict[str, Any], png: Path) -> Path:
    """Per-step curves (mean over seeds, band = seed range) and the held-out accuracy per run with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    by_algo: dict[str, list[dict[str, Any]]] = {}
    for r in results.values():
        if r["algorithm"] != "sft":
            by_algo.setdefault(r["algorithm"], []).append(r)
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
    _accuracy_panel(axes.flat[5], by_algo, sft)
    fig.suptitle("GRPO vs ARPO vs AEPO from one SFT policy (SmolLM2-135M, 3-digit products with <python>)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return png


def _accuracy_panel(ax, by_algo: dict[str, list[dict[str, Any]]], sft: dict[str, Any]) -> None:
    h = sft["heldout"]
    ax.axhspan(h["ci_low"], h["ci_high"], color="grey", alpha=0.2)
    ax.axhline(h["accuracy"], color="grey", label=f"SFT {h['accuracy']:.2f}")
    x = 0
    for algo, runs in by_algo.items():
        for run in sorted(runs, key=lambda r: r["seed"]):
            e = run["heldout"]
            ax.errorbar([x], [e["accuracy"]], yerr=[[e["accuracy"] - e["ci_low"]], [e["ci_high"] - e["accuracy"]]],
                        fmt="o", color=COLORS.get(algo), capsize=3)
            x += 1
        x += 0.5
    labels = [f"{a}\ns{r['seed']}" for a, runs in by_algo.items() for r in sorted(runs, key=lambda r: r["seed"])]
    ticks, x = [], 0.0
    for runs in by_algo.values():
        ticks += [x + i for i in range(len(runs))]
        x += len(runs) + 0.5
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_title("held-out accuracy after RL (95% bootstrap)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def report(results: dict[str, dict[str, Any]], timing: dict[str, Any], root: Path, missing: list[str]) -> Path | None:
    """Print the table and verdicts, write summary.json and learning.png, publish them inside a flow run."""
    from tabulate import tabulate

    from stages.core.atomic import write_json

    sft = results.get("sft")
    if sft is None:
        print("no SFT evaluation yet; nothing to report")
        return None
    by_algo: dict[str, list[dict[str, Any]]] = {}
    for r in results.values():
        if r["algorithm"] != "sft":
            by_algo.setdefault(r["algorithm"], []).append(r)
    summaries = {algo: algorithm_summary(runs, sft) for algo, runs in by_algo.items()}
    for algo, s in summaries.items():  # CPU of every attempt (RL + its held-out evaluation), per run
        cpu = [a["cpu_s"] for a in timing.get("attempts", []) if a["job"].split(":")[0] == algo]
        s["cpu_min_per_run"] = sum(cpu) / 60 / max(1, len(s["seeds"]))
    rows = table_rows(summaries, sft)
    lines = verdicts(summaries, sft)
    print("\n" + tabulate(rows, headers="keys", tablefmt="github"))
    print("\n" + "\n".join(lines))
    print("\n" + timing_text(timing))
    png = plot(results, sft, root / "learning.png") if by_algo else None
    write_json(root / "summary.json", {"summaries": summaries, "verdicts": lines, "table": rows, "timing": timing,
                                       "missing": missing})
    _publish(rows, lines, png)
    return png


def timing_text(timing: dict[str, Any]) -> str:
    """Wall and CPU time: a single-threaded run's CPU seconds are what it would take alone on an idle core."""
    runs = [a for a in timing.get("attempts", []) if a["job"] != "sft"]
    cpu = sum(a["cpu_s"] for a in runs)
    wall = max((a["wall_s"] for a in runs), default=0.0)
    sft = timing.get("sft", {})
    train = sft.get("train_runtime_s")
    return (f"time: bench {timing['bench_wall_s'] / 60:.1f} min wall this invocation (mean load average "
            f"{timing['mean_load']:.1f} on 2 cores); data + SFT when first built {sft.get('wall_s', 0) / 60:.1f} min "
            f"wall, {sft.get('cpu_s', 0) / 60:.1f} min CPU (LLaMA-Factory train_runtime "
            f"{(train or 0) / 60:.1f} min); RL+eval runs {len(runs)} attempts, {cpu / 60:.1f} min CPU in "
            f"all, longest attempt {wall / 60:.1f} min wall; idle-box estimate with 2 runs at a time: "
            f"{(sft.get('cpu_s', 0) / 2 + cpu / 2) / 60:.0f} min")


def _publish(rows: list[dict[str, str]], lines: list[str], png: Path | None) -> None:
    from tasks.artifacts import publish_image, publish_markdown, publish_table

    publish_table("bench-learning", rows, "GRPO vs ARPO vs AEPO from one SFT policy: held-out accuracy and training")
    publish_markdown("bench-learning-verdicts", "\n".join(f"- {line}" for line in lines))
    if png is not None:
        publish_image("bench-learning-curves", png, "per-step curves and held-out accuracy")
