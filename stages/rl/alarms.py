"""Collapse alarms: pure checks over the stream of per-step metric rows, and the watcher the trainer calls.

Each check reads `history` (every metrics row so far, oldest first; the last is the step just made) and the
thresholds in `rl.alarms` (AlarmSection), and returns an `Alarm` for that step or None:

- tool_collapse: tool calls per trajectory fell below `tool_drop_ratio` x their best earlier value (once that
  was at least `tool_min_peak`): the policy stopped using its tools.
- tool_unused: the run's first step made no tool call at all although the prompt offers tools (`tools/offered`):
  the policy never used them (tool_collapse needs an earlier peak to fall from).
- entropy_collapse: mean token entropy below `entropy_drop_ratio` x the first step's, or below `entropy_floor`.
- format_errors_rising: the format-error rate averaged over the last `window` steps is `format_error_rise`
  above the lowest average over any earlier `window` steps.
- reward_at_floor: mean reward within `reward_floor_tol` of `reward_floor` for `window` steps in a row.
- no_signal_groups: at least `no_signal_fraction` of the groups had all-equal rewards (zero advantage, no
  gradient) for `window` steps in a row.
- reward_collapse: mean reward `reward_drop` below its best earlier value.
- formed_but_wrong: the "well-formed but wrong" collapse, which reward_collapse misses when the format errors fall as
  the answers go wrong (a malformed answer scores -1, a wrong well-formed one 0, so the reward barely moves): at a
  step whose format-error rate is at most `formed_max_format_error`, the accuracy among well-formed answers
  (accuracy / (1 - format-error rate)) is `formed_accuracy_drop` below its best at an earlier such step. Steps with
  more format errors are not compared: their few well-formed answers make the ratio noise.
- nonfinite_loss: loss, gradient norm, reward or entropy is NaN or infinite.
- infra_failures: at least `infra_share` of the step's trajectories were touched by a tool infrastructure
  failure (the search provider, retrieval server or sandbox failed a call) and left out of the loss: the step
  trained on fewer samples than configured, and an outage may be under way (upstream ARPO issue #49).
- sampler_drift: the rollout engine's log-probs of the tokens it sampled vs the trainer's
  (`rollout/logp_mismatch`, per token) at `drift_ratio` x the first step's value or more, and above `drift_floor`; or
  above `drift_max` at any step. The first step's sampler is loaded from the same files as the trainer, so its
  mismatch is the numerical floor of the two engines; a later rise means the sampler is not the policy (a weight
  refresh that skipped tensors: a tied LM head never reached vLLM before issue 37). In stop_on by default.
- trees_dropped (verl engine): at least `trees_dropped_share` of the step's trees raised in the agent-loop worker
  and were dropped whole (`rollout/trees_dropped`); the message splits them into infrastructure failures
  (`rollout/trees_dropped_infra`: sandbox, search, server, network) and the rest (`rollout/trees_dropped_other`).

`AlarmWatch` applies them after each step: flags `alarm/<name>` in the row, logs a warning, appends to
`alarms.jsonl`, reports an event and the `rl-alarms` markdown through stages.core.reporter, and raises
`AlarmStop` (a DeterministicError: a retry would hit it again) for the alarms in `stop_on`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages.core import reporter
from stages.core.atomic import read_jsonl
from stages.core.config.rl import AlarmSection
from stages.core.errors import DeterministicError
from stages.core.log import get_logger

log = get_logger(__name__)
Row = dict[str, Any]


@dataclass(frozen=True)
class Alarm:
    name: str
    step: int
    message: str


class AlarmStop(DeterministicError):
    """An alarm named in rl.alarms.stop_on fired."""


def _values(history: list[Row], key: str) -> list[float]:
    return [float(r[key]) for r in history if key in r]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def tool_collapse(history: list[Row], rules: AlarmSection) -> str | None:
    calls = _values(history, "tools/calls_per_traj")
    if len(calls) < 2:
        return None
    peak, now = max(calls[:-1]), calls[-1]
    if peak >= rules.tool_min_peak and now < rules.tool_drop_ratio * peak:
        return f"tool calls per trajectory {now:.3g}, down from a best of {peak:.3g} (< {rules.tool_drop_ratio:g}x)"
    return None


def tool_unused(history: list[Row], rules: AlarmSection) -> str | None:
    """The run's first step made no tool call although the prompt offers tools: tool_collapse cannot see it (no
    earlier peak to fall from), and a policy that never calls its tools trains a tools profile on nothing."""
    calls = _values(history, "tools/calls_per_traj")
    offered = history[-1].get("tools/offered")
    if len(calls) == 1 and calls[0] == 0 and offered:
        return (f"no tool call at the first step although the prompt offers {offered:.0f} tool(s): the policy does "
                "not use its tools (check the prompt template, the SFT stage and the stop tags)")
    return None


def entropy_collapse(history: list[Row], rules: AlarmSection) -> str | None:
    entropy = _values(history, "entropy/mean")
    if not entropy:
        return None
    first, now = entropy[0], entropy[-1]
    if now < rules.entropy_floor:
        return f"mean token entropy {now:.3g} < floor {rules.entropy_floor:g}"
    if len(entropy) > 1 and now < rules.entropy_drop_ratio * first:
        return f"mean token entropy {now:.3g}, under {rules.entropy_drop_ratio:g}x the first step's {first:.3g}"
    return None


def format_errors_rising(history: list[Row], rules: AlarmSection) -> str | None:
    rates, w = _values(history, "reward/format_error_rate"), rules.window
    if len(rates) < 2 * w:
        return None
    recent = _mean(rates[-w:])
    best = min(_mean(rates[i:i + w]) for i in range(len(rates) - 2 * w + 1))
    if recent >= best + rules.format_error_rise:
        return (f"format-error rate {recent:.2f} over the last {w} steps, up from {best:.2f} "
                f"(rise >= {rules.format_error_rise:g})")
    return None


def reward_at_floor(history: list[Row], rules: AlarmSection) -> str | None:
    rewards, w = _values(history, "reward/mean"), rules.window
    if len(rewards) >= w and all(r <= rules.reward_floor + rules.reward_floor_tol for r in rewards[-w:]):
        return f"mean reward at the floor {rules.reward_floor:g} for {w} steps ({rewards[-1]:.3g} now)"
    return None


def no_signal_groups(history: list[Row], rules: AlarmSection) -> str | None:
    flat, w = _values(history, "reward/groups_without_signal"), rules.window
    if len(flat) >= w and all(f >= rules.no_signal_fraction for f in flat[-w:]):
        return (f"{flat[-1]:.0%} of groups had all-equal rewards (no gradient); >= {rules.no_signal_fraction:.0%} "
                f"for {w} steps")
    return None


def reward_collapse(history: list[Row], rules: AlarmSection) -> str | None:
    rewards = _values(history, "reward/mean")
    if len(rewards) < 2:
        return None
    peak, now = max(rewards[:-1]), rewards[-1]
    if now < peak - rules.reward_drop:
        return f"mean reward {now:.3g}, {peak - now:.3g} below its best {peak:.3g} (drop >= {rules.reward_drop:g})"
    return None


def formed_but_wrong(history: list[Row], rules: AlarmSection) -> str | None:
    ratios = [(int(r.get("step", i + 1)), float(r["accuracy"]) / (1 - float(r["reward/format_error_rate"])))
              for i, r in enumerate(history) if "accuracy" in r and "reward/format_error_rate" in r
              and float(r["reward/format_error_rate"]) <= rules.formed_max_format_error]
    last = history[-1]
    if len(ratios) < 2 or ratios[-1][0] != int(last.get("step", len(history))):
        return None  # the step just made is not a well-formed one, or there is nothing to compare it with
    (best_step, best), now = max(ratios[:-1], key=lambda x: x[1]), ratios[-1][1]
    if now < best - rules.formed_accuracy_drop:
        return (f"well-formed but wrong: accuracy among well-formed answers {now:.3g} (format errors "
                f"{float(last['reward/format_error_rate']):.3g}), {best - now:.3g} below its best {best:.3g} at step "
                f"{best_step} (drop >= {rules.formed_accuracy_drop:g}): the policy answers in form and gets it wrong")
    return None


def nonfinite_loss(history: list[Row], rules: AlarmSection) -> str | None:
    row = history[-1]
    bad = [f"{key}={row[key]}" for key in ("loss", "grad_norm", "reward/mean", "entropy/mean")
           if isinstance(row.get(key), (int, float)) and not math.isfinite(row[key])]
    return f"non-finite {', '.join(bad)}" if bad else None


def infra_failures(history: list[Row], rules: AlarmSection) -> str | None:
    row = history[-1]
    share = row.get("rollout/masked_share")
    if share is None or share < rules.infra_share or share == 0:
        return None
    masked, total = row.get("rollout/masked_trajectories"), row.get("rollout/trajectories")
    count = f"{masked:.0f} of {total:.0f} trajectories" if masked is not None and total else "trajectories"
    return (f"{count} ({share:.0%}) hit a tool infrastructure failure ({row.get('tools/infra_failures', 0):.0f} "
            f"failed calls: search provider, retrieval server or sandbox) and were left out of the loss "
            f"(>= {rules.infra_share:.0%})")


def trees_dropped(history: list[Row], rules: AlarmSection) -> str | None:
    row = history[-1]
    dropped = row.get("rollout/trees_dropped")
    if not dropped:
        return None
    total = dropped + row.get("rollout/trees_trained", 0.0)
    share = dropped / total
    if share < rules.trees_dropped_share:
        return None
    infra = row.get("rollout/trees_dropped_infra", 0.0)
    return (f"{dropped:.0f} of {total:.0f} trees ({share:.0%}) failed and were dropped "
            f"(>= {rules.trees_dropped_share:.0%}): {infra:.0f} on the infrastructure (sandbox, search provider, "
            f"LLM server, network), {dropped - infra:.0f} other (see verl.log for the tracebacks)")


def sampler_drift(history: list[Row], rules: AlarmSection) -> str | None:
    mismatch = _values(history, "rollout/logp_mismatch")
    if not mismatch or not math.isfinite(mismatch[-1]):
        return None
    first, now = mismatch[0], mismatch[-1]
    why = ("the rollout engine is not sampling from the policy being trained (a weight refresh that left tensors "
           "behind, e.g. a tied LM head, or different weights loaded): the old log-probs and the samples are off-policy")
    if now > rules.drift_max:
        return f"sampler vs trainer log-prob mismatch {now:.3g} per token > drift_max {rules.drift_max:g}: {why}"
    if len(mismatch) > 1 and now > rules.drift_floor and now >= rules.drift_ratio * first:
        return (f"sampler vs trainer log-prob mismatch {now:.3g} per token, {now / first if first else math.inf:.3g}x "
                f"the first step's {first:.3g} (>= {rules.drift_ratio:g}x and > {rules.drift_floor:g}): {why}")
    return None


CHECKS: dict[str, Callable[[list[Row], AlarmSection], str | None]] = {
    "tool_collapse": tool_collapse, "tool_unused": tool_unused, "entropy_collapse": entropy_collapse,
    "format_errors_rising": format_errors_rising, "reward_at_floor": reward_at_floor,
    "no_signal_groups": no_signal_groups, "reward_collapse": reward_collapse, "formed_but_wrong": formed_but_wrong,
    "nonfinite_loss": nonfinite_loss,
    "infra_failures": infra_failures, "trees_dropped": trees_dropped, "sampler_drift": sampler_drift}


DEFAULT_RULES = AlarmSection()


def detect_alarms(history: list[Row], rules: AlarmSection = DEFAULT_RULES) -> list[Alarm]:
    """The alarms the last row of `history` raises, in CHECKS order."""
    if not history or not rules.enabled:
        return []
    step = int(history[-1].get("step", len(history)))
    return [Alarm(name, step, message) for name, check in CHECKS.items()
            if (message := check(history, rules)) is not None]


def alarms_markdown(alarms: list[Alarm], rules: AlarmSection) -> str:
    lines = [f"## ⚠ RL health: {len(alarms)} alarm(s), latest at step {alarms[-1].step}" if alarms
             else "## RL health: no alarm", "",
             "| step | alarm | what | action |", "|---|---|---|---|"]
    lines += [f"| {a.step} | **{a.name}** | {a.message} | {'stop' if a.name in rules.stop_on else 'warn'} |"
              for a in alarms]
    lines += ["", f"Thresholds: `rl.alarms` = `{rules.model_dump(mode='json')}` (docs/rl.md, Metrics and alarms)."]
    return "\n".join(lines)


class AlarmWatch:
    """Checks each new step, keeps `alarms.jsonl` in the stage folder, tells the watcher, stops on request."""

    def __init__(self, rules: AlarmSection, path: Path, resumed_step: int = 0) -> None:
        self.rules, self.path = rules, Path(path)
        # alarms of steps a resumed run will redo are dropped: they are raised again if they still hold
        self.alarms = [Alarm(**r) for r in (read_jsonl(self.path) if self.path.is_file() else [])
                       if int(r["step"]) <= resumed_step]

    def check(self, history: list[Row]) -> list[Alarm]:
        found = detect_alarms(history, self.rules)
        row = history[-1]
        row["alarm"] = float(bool(found))
        for alarm in found:
            row[f"alarm/{alarm.name}"] = 1.0
            log.warning("step %d: alarm %s: %s", alarm.step, alarm.name, alarm.message)
            reporter.event(f"arpo.rl.alarm.{alarm.name}", {**asdict(alarm), "stops_run": alarm.name in
                                                           self.rules.stop_on})
        if found:
            self.alarms += found
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.writelines(json.dumps(asdict(a)) + "\n" for a in found)
            reporter.markdown("rl-alarms", alarms_markdown(self.alarms, self.rules), "RL collapse alarms")
        stops = [a for a in found if a.name in self.rules.stop_on]
        if stops:
            raise AlarmStop(f"RL stopped at step {stops[0].step}: alarm {stops[0].name} ({stops[0].message}); it is "
                            f"in rl.alarms.stop_on, so this step was not saved. Fix the cause (e.g. rl.optim.lr) or "
                            f"remove it from rl.alarms.stop_on; a rerun resumes from the last checkpoint")
        return found
