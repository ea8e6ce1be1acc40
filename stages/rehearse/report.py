"""The rehearsal report (`rehearsal.md` + `rehearsal.json` in the run record): what was changed and why, each seam
check, the real-scale estimate, per stage whether it ran in this rehearsal and for how long, self-critic DPO's pairs
(counted, one shown) when the profile runs it, and what the toy's RL steps saw (reward signal, tool calls,
rollout-vs-trainer log-prob agreement, gradient)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.core.atomic import read_jsonl, write_json, write_text
from stages.rehearse.rule import Rehearsal

MARKER = "_COMPLETE.json"


# What each RL step's row of metrics.jsonl shows about the seams, with the report's column names
RL_COLUMNS = {"step": "step", "reward/mean": "reward mean", "reward/format_error_rate": "format errors",
              "reward/groups_without_signal": "groups without signal", "tools/calls_per_traj": "tool calls / traj",
              "rollout/logp_mismatch": "log-prob mismatch", "grad_norm": "grad norm"}


def stage_folder(path: str | Path, depth: int = 4) -> Path | None:
    """The stage folder (the one with a completion marker) that holds `path` (a model folder, a checkpoint, a file)."""
    folder = Path(path)
    for candidate in [folder, *folder.parents][:depth + 1]:
        if (candidate / MARKER).is_file():
            return candidate
    return None


def stage_marker(path: str | Path, depth: int = 4) -> dict[str, Any] | None:
    """The completion marker of the stage folder that holds `path`."""
    folder = stage_folder(path, depth)
    return json.loads((folder / MARKER).read_text()) if folder else None


def rl_steps(refs: dict[str, Any]) -> list[dict[str, Any]]:
    """The RL stage's per-step rows (metrics.jsonl), only the RL_COLUMNS; [] without an RL stage in the run."""
    ref = refs.get("rl")
    folder = stage_folder(ref["path"]) if isinstance(ref, dict) and ref.get("path") else None
    metrics = folder / "metrics.jsonl" if folder else None
    if metrics is None or not metrics.is_file():
        return []
    return [{**{key: row[key] for key in RL_COLUMNS if key in row},
             "alarms": ", ".join(sorted(k.removeprefix("alarm/") for k in row if k.startswith("alarm/")))}
            for row in read_jsonl(metrics)]


def rl_lines(steps: list[dict[str, Any]]) -> list[str]:
    """The report's RL section: a table of the steps and what a reader should make of them."""
    if not steps:
        return ["no RL stage in this rehearsal"]
    lines = ["| " + " | ".join([*RL_COLUMNS.values(), "alarms"]) + " |", "|" + "---|" * (len(RL_COLUMNS) + 1)]
    for row in steps:
        cells = [row.get(key) for key in [*RL_COLUMNS, "alarms"]]
        lines.append("| " + " | ".join("" if c is None else f"{c:.3g}" if isinstance(c, float) else str(c)
                                       for c in cells) + " |")
    if all(row.get("reward/groups_without_signal") == 1.0 for row in steps):
        lines += ["", "No reward signal: in every group all trajectories scored alike (expected of a random-init toy), "
                  "so the advantages and the policy gradient were zero (an entropy or KL term aside): the update ran "
                  "but cannot have moved the weights by its policy loss."]
    mismatch = max((row.get("rollout/logp_mismatch") or 0.0 for row in steps), default=0.0)
    lines += ["", f"Log-prob mismatch (the rollout engine's sampled tokens' log-probs vs the trainer's, mean absolute "
              f"difference) at most {mismatch:.3g}: float32 engines agree to ~1e-5, except on a toy whose embedding "
              "has more rows than its tokenizer has tokens (Qwen: 151,936 for 151,669): the sampler draws only the "
              "tokenizer's ids, so with random weights the two differ by log(rows / tokens) ~ 1.8e-3 at every step; a "
              "large value, or one that grows after the first step, means the two see different tokens or weights "
              "(template, tokenizer, weight sync: the sampler_drift alarm)."]
    if any("sampler_drift" in (row.get("alarms") or "") for row in steps):
        lines += ["", "**sampler_drift fired**: the rollout engine's log-probs moved away from the trainer's after the "
                  "first step, so the engine was not sampling from the policy being trained (docs/rl.md, The sampler "
                  "is the policy)."]
    return lines


DPO_EXAMPLE_CHARS = 600   # each side of the shown pair, from its start


def dpo_pairs(refs: dict[str, Any], examples: int = 1) -> dict[str, Any] | None:
    """Self-critic DPO in this run (stages/sft/dpo.py): the pair counts, the training metrics and the first
    `examples` pairs (question, chosen, rejected; long sides cut); None without a DPO stage in the run."""
    ref = refs.get("dpo")
    folder = stage_folder(ref["path"]) if isinstance(ref, dict) and ref.get("path") else None
    if folder is None or not (folder / "pairs" / "counts.json").is_file():
        return None
    pairs = folder / "pairs" / "self_critic_dpo.jsonl"
    rows = read_jsonl(pairs) if pairs.is_file() else []
    metrics = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").is_file() else {}
    cut = lambda text: text if len(text) <= DPO_EXAMPLE_CHARS else text[:DPO_EXAMPLE_CHARS] + " [...]"  # noqa: E731
    return {"counts": json.loads((folder / "pairs" / "counts.json").read_text()), "rows": len(rows),
            "training": {k: metrics[k] for k in ("steps", "loss_first", "loss_last") if k in metrics},
            "examples": [{"question": cut(r["conversations"][-1]["value"]), "chosen": cut(r["chosen"]["value"]),
                          "rejected": cut(r["rejected"]["value"])} for r in rows[:examples]]}


def dpo_lines(dpo: dict[str, Any] | None) -> list[str]:
    """The report's self-critic DPO section."""
    if dpo is None:
        return ["no self-critic DPO stage in this rehearsal (sft.dpo.enabled is false)"]
    counts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in dpo["counts"].items())
    train = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                      for k, v in dpo["training"].items())
    lines = [f"- pairs: {dpo['rows']} in the LLaMA-Factory ranking file ({counts})", f"- training: {train or '-'}"]
    for i, pair in enumerate(dpo["examples"], start=1):
        lines += ["", f"Pair {i}, question: {pair['question']}", "", "chosen:", "", "```", pair["chosen"], "```", "",
                  "rejected:", "", "```", pair["rejected"], "```"]
    return lines


def stage_timings(refs: dict[str, Any], started_at: float) -> list[dict[str, Any]]:
    """Per stage of the run's refs: ran in this rehearsal (finished after `started_at`) or came from an earlier
    run's outputs, and the wall time between its finish and the previous stage's (the stages run one after the
    other, so that is the stage's time, its Prefect bookkeeping included)."""
    rows = []
    for name, ref in refs.items():
        first = ref[0] if isinstance(ref, list) and ref else ref
        if not isinstance(first, dict):
            continue
        marker = stage_marker(first.get("path", "")) if first.get("path") else None
        finished = marker.get("finished_at") if marker else None
        rows.append({"stage": name, "path": first.get("path") or first.get("url", ""),
                     "finished_at": finished, "ran": bool(finished and finished >= started_at)})
    previous = started_at
    for row in sorted((r for r in rows if r["ran"]), key=lambda r: r["finished_at"]):
        row["seconds"] = round(row["finished_at"] - previous, 1)
        previous = row["finished_at"]
    return rows


def write_report(run_dir: str | Path, rehearsal: Rehearsal, seams: list[Any] | None, real_scale: dict[str, Any],
                 timings: list[dict[str, Any]], wall_s: float, steps: list[dict[str, Any]] | None = None,
                 dpo: dict[str, Any] | None = None) -> Path:
    """Write rehearsal.json and rehearsal.md into the run record; returns the markdown's path. `steps`: rl_steps;
    `dpo`: dpo_pairs."""
    run_dir = Path(run_dir)
    seam_rows = [{"check": s.name, "ok": s.ok, "detail": s.detail} for s in seams or []]
    write_json(run_dir / "rehearsal.json", {**rehearsal.to_json(), "seam_checks": seam_rows, "real_scale": real_scale,
                                            "stages": timings, "rl_steps": steps or [], "dpo": dpo,
                                            "wall_s": round(wall_s, 1)})
    lines = [f"# Rehearsal of {rehearsal.profile}", "",
             "**A rehearsal, not a run of the profile**: a random-init toy model of the profile's architecture with its "
             "real tokenizer, at toy scale, with the swaps below. Its scores mean nothing; what it shows is that every "
             "stage of this profile runs and fits together.", "",
             f"Wall time: {wall_s / 60:.1f} min.", "", "## Stages", "", "| stage | ran here | time | output |",
             "|---|---|---|---|"]
    for row in timings:
        took = f"{row['seconds']:.0f} s" if "seconds" in row else ("earlier run's output" if not row["ran"] else "")
        lines.append(f"| {row['stage']} | {'yes' if row['ran'] else 'no (cached)'} | {took} | `{row['path']}` |")
    lines += ["", "## Seam checks (docs/seams.md)", ""]
    if seam_rows:
        lines += ["| check | result | detail |", "|---|---|---|"]
        lines += [f"| {r['check']} | {'ok' if r['ok'] else 'FAILED'} | {r['detail']} |" for r in seam_rows]
    else:
        lines.append("not run (no stage that reads the tokenizer was planned)")
    if dpo is not None:
        lines += ["", "## Self-critic DPO (its pairs from the SFT'd toy's self-samples)", "", *dpo_lines(dpo)]
    lines += ["", "## The toy's RL steps (metrics.jsonl; its scores mean nothing)", "", *rl_lines(steps or [])]
    lines += ["", "## At the profile's real scale", ""]
    lines += [f"- {key}: {value}" for key, value in real_scale.items()] or ["(no estimate)"]
    lines += ["", "## What the rehearsal changed (stages/rehearse/rule.py)", "", rehearsal.table(), ""]
    path = run_dir / "rehearsal.md"
    write_text(path, "\n".join(lines))
    return path
