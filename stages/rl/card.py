"""The algorithm card of an RL run: each mechanism, its value in this run, the reference code's at the published
run it is compared with, and "same" or "differs" with why (docs/reference.md has every fact with file:line).

    card = algorithm_card(cfg.rl)          # pure: no prefect, no verl import
    card_markdown(card)                    # the stage folder's algorithm_card.md and `arpo config show --card`
    card_table(card)                       # the Prefect table artifact `rl-algorithm-card`

What depends on the algorithm (independent samples or a tree, its branch rule, a branch penalty) is read from its
line in stages/core/algorithm_spec.py, never from its name. The loss-side rows read what the engine actually trains
with: the RL section for the local engine, the verl
hydra overrides that `stages.rl.verl.mapping.verl_overrides` produces for the verl engine (the rollout and
advantage sections reach verl's workers unchanged through the plugin settings). The same config therefore gives
the same card on both engines unless the mapping sets something else, which `tests/unit/test_rl_card.py` checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stages.core.algorithm_spec import ALGORITHMS, AlgorithmSpec
from stages.core.config.agent import AgentSection
from stages.core.config.rl import RLSection, RolloutSection
from stages.core.engine_spec import VERL_VERSION
from stages.core.registry import Registry
from stages.rl.reference_code import DOC, NO_DUAL_CLIP, ReferenceSetting, reference_for
from stages.rl.strategies import BRANCH_RULES


@dataclass(frozen=True)
class CardRow:
    mechanism: str
    value: str        # in this run
    reference: str    # in the reference code at the compared published run
    verdict: str      # same | differs
    why: str = ""     # for differences: why, and what reproduces the reference
    link: str = ""


@dataclass(frozen=True)
class AlgorithmCard:
    algorithm: str
    engine: str
    reference: ReferenceSetting
    rows: list[CardRow]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Trained:
    """What the engine trains with, in this project's vocabulary."""

    policy_loss: str
    clip: tuple[float, float, float]
    aggregation: str
    kl_coef: float
    kl_type: str
    entropy_coef: float
    reward: str
    source: str       # where it was read


# what each engine (stages/core/engine_spec.py) trains with, read from its own inputs, registered by its name
TRAINED: Registry[Callable[[RLSection], Trained]] = Registry("trained settings")


@TRAINED.register("local")
def trained_local(rl: RLSection) -> Trained:
    loss = rl.loss
    return Trained(loss.policy_loss, (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c),
                   loss.aggregation, loss.kl_coef, loss.kl_type, loss.entropy_coef, rl.trainer.reward,
                   "the local trainer reads the rl section")


@TRAINED.register("verl")
def trained_verl(rl: RLSection) -> Trained:
    """Read back from the overrides the verl engine launches with (inverse of the mapping's name tables)."""
    from stages.rl.verl.mapping import AGG_MODES, KL_TYPES, POLICY_LOSSES, VerlPaths, verl_overrides

    paths = VerlPaths(*(f"<{name}>" for name in ("model", "train", "val", "checkpoints", "settings",
                                                  "agent_loops", "rollouts")))
    o = dict(item.split("=", 1) for item in verl_overrides(rl, "bfloat16", 0, paths))
    actor = "actor_rollout_ref.actor."
    inverse = lambda table, value: {v: k for k, v in table.items()}[value]  # noqa: E731
    kl_coef = float(o[f"{actor}kl_loss_coef"]) if o[f"{actor}use_kl_loss"] == "true" else 0.0
    return Trained(inverse(POLICY_LOSSES, o[f"{actor}policy_loss.loss_mode"]),
                   (float(o[f"{actor}clip_ratio_low"]), float(o[f"{actor}clip_ratio_high"]),
                    float(o[f"{actor}clip_ratio_c"])),
                   inverse(AGG_MODES, o[f"{actor}loss_agg_mode"]), kl_coef,
                   inverse(KL_TYPES, o[f"{actor}kl_loss_type"]), float(o[f"{actor}entropy_coeff"]),
                   o["+reward.custom_reward_function.reward_kwargs.reward"],
                   f"read back from the verl {VERL_VERSION} overrides of stages.rl.verl.mapping")


def _row(mechanism: str, value: str, reference: str, why: str = "", anchor: str = "", same: bool | None = None,
         note: str = "") -> CardRow:
    """`why` explains a difference; `note` is kept either way (a nuance of a 'same')."""
    same = value == reference if same is None else same
    return CardRow(mechanism, value, reference, "same" if same else "differs",
                   "; ".join(t for t in ("" if same else why, note) if t), f"{DOC}#{anchor}" if anchor else "")


SCHEDULE_TEXT = {"rounds": "rounds: every generation of a round, then its tool calls",
                 "early_tools": "early_tools: each tool call starts when its generation returns",
                 "async": "async: each trajectory runs ahead; draws at each group's round close"}
SCHEDULE_SAME = {
    "rounds": "",
    "early_tools": "same trees bit for bit: the weights do not change within a rollout, every draw stays at the "
                   "round's end in creation order, and a copy forked at a segment's start takes the CallState from "
                   "before its parent's call (docs/rollout.md, Schedules)",
    "async": "same trees as rounds with counter-based seeds (tree seed, trajectory, segment; a generator per group), "
             "hence the same distribution: the weights do not change within a rollout, a group's draws see its "
             "members as they were at its round's end (snapshots), in creation order, and no draw depends on "
             "timing (docs/rollout.md, Schedules)"}


def reference_rollout(ref: ReferenceSetting) -> RolloutSection:
    """The reference's rollout as our section (every rule set to the reference's own; its algorithm is
    `ref.algorithm`)."""
    return RolloutSection(n=ref.n, initial_rollouts=ref.initial_rollouts,
                          beam_size=ref.beam_size, branch_probability=ref.branch_probability,
                          entropy_weight=ref.entropy_weight, branch_penalty=ref.branch_penalty,
                          dynamic_rollouts=ref.dynamic_rollouts, call_limit=ref.call_limit)


def _initial(spec: AlgorithmSpec, ro: RolloutSection) -> str:
    if not spec.branches:
        return f"n = {ro.n} samples from the prompt"
    if ro.dynamic_rollouts:
        return (f"n = {ro.n}; initial roots clamp(floor(n sigmoid({ro.dynamic_beta} (H_root - H_tool))) + 1, 1, n) "
                f"(probe {ro.probe_tokens} tokens)")
    return f"n = {ro.n}; {ro.initial_rollouts} initial roots"


def _rule(spec: AlgorithmSpec, ro: RolloutSection) -> str:
    if not spec.branches:
        return "none"
    return BRANCH_RULES.get(spec.branch_rule).formula(ro)  # written once, beside the rule's code


def _counter(spec: AlgorithmSpec, ro: RolloutSection) -> str:
    if not spec.governs("rollout.branch_penalty") or ro.branch_penalty == 0:
        return "none"
    if ro.penalty_counter == "consecutive_rounds":
        return "c = consecutive rounds that added copies or fresh roots to the prompt (0 after one that added none)"
    return "c = copies the prompt made this rollout (same-round copies included)"


def _draws(spec: AlgorithmSpec, ro: RolloutSection) -> str:
    if not spec.branches:
        return "none"
    return (f"min(beam_size - 1, budget left) = min({ro.beam_size - 1}, .) draws per candidate, fixed before "
            "drawing; candidates in creation order")


def _fresh(spec: AlgorithmSpec, ro: RolloutSection) -> str:
    if not spec.branches:
        return "none"
    return ("one fresh root per round while the prompt has no active trajectory and budget left"
            if ro.fresh_fill == "one" else "the whole leftover budget at once when no trajectory is active")


def _quantity(ro: RolloutSection) -> str:
    return {"topk": f"top-{ro.entropy_topk} log-probs + the sampled token: -sum p log p / ln|V|",
            "full": "whole-vocabulary entropy / ln|V|",
            "surprisal": "the sampled token's -log p / ln|V|"}.get(ro.entropy_quantity, ro.entropy_quantity)


def _window(ro: RolloutSection) -> str:
    where = ("every segment, the decision one round late (after the call its segment ended in)"
             if ro.entropy_window == "reference" else "the segment after each tool result, fork at its start")
    return f"first {ro.entropy_tokens} tokens of {where}, " + \
        ("summed" if ro.entropy_aggregation == "sum" else "averaged")


def rollout_rows(algorithm: str, ro: RolloutSection, ref: ReferenceSetting) -> list[CardRow]:
    spec, theirs, their_spec = ALGORITHMS.get(algorithm), reference_rollout(ref), ALGORITHMS.get(ref.algorithm)
    rows = [
        _row("rollout strategy", algorithm, ref.algorithm, anchor="published-runs"),
        _row("group size and initial roots", _initial(spec, ro), _initial(their_spec, theirs),
             "a different value than the published run (profile setting)", "published-runs"),
        _row("branch rule", _rule(spec, ro), _rule(their_spec, theirs),
             "a different value than the published run (profile setting)", "branch-rules"),
        _row("penalty counter c", _counter(spec, ro), _counter(their_spec, theirs),
             "rl.rollout.penalty_counter=branches is an earlier reading; the reference counts consecutive rounds",
             "penalty-counter", note="the reference moves every prompt's c only in rounds in which some prompt of "
             "the rollout worker's batch added one; here each prompt's c moves every round"
             if _counter(spec, ro).startswith("c = consecutive") else ""),
        _row("copies per candidate", _draws(spec, ro), _draws(their_spec, theirs), "a different beam_size",
             "branch-rules"),
        _row("fresh roots", _fresh(spec, ro), _fresh(their_spec, theirs), "fresh_fill=all is an option (fewer rounds)",
             "budget-and-fresh-roots"),
        _row("tool calls per trajectory", str(ro.call_limit), str(theirs.call_limit),
             "a different value than the published run (profile setting)", "published-runs"),
        _row("rollout schedule", SCHEDULE_TEXT[ro.schedule], SCHEDULE_TEXT["rounds"], anchor="rollout-schedule",
             same=True, note=SCHEDULE_SAME[ro.schedule]),
    ]
    if spec.branches:
        rows += [
            _row("entropy quantity", _quantity(ro), _quantity(theirs),
                 "verl's stock server returns only the sampled token's log-prob; rl.rollout.entropy_quantity=topk "
                 "uses our top-k server replica" if ro.entropy_quantity == "surprisal" else
                 "an option (transformers backend)", "entropy"),
            _row("entropy window", _window(ro), _window(theirs), "the paper's description as an option",
                 "entropy"),
            _row("entropy baseline H_initial", "the trajectory's first measured segment, reset every rollout",
                 "the first segment per trajectory index, never cleared: stale from the second step on",
                 "a bug in the reference (indices restart every step)", "entropy"),
        ]
    return rows


def _advantage(rl: RLSection) -> str:
    return (f"{rl.advantage.estimator}: (R - mean_g R) / (std_g R + {rl.advantage.eps:g}), unbiased std, the "
            "prompt's n trajectories")


def _entropy_aware(rl: RLSection) -> str:
    adv = rl.advantage
    if not adv.entropy_aware:
        return "off"
    where = ("the rollout policy's token entropy, standardised over the step" if adv.entropy_scope == "step" else
             "the current policy's token entropy, standardised per micro-batch inside the loss")
    return f"A (1 + {adv.entropy_alpha} sg(H_std)), H_std from {where}"


def _policy_loss(t: Trained) -> str:
    low, high, c = t.clip
    shape = ("AEPO entropy-balanced clip: upper bound (1 + eps_high) r / sg(r), gradient kept above it"
             if t.policy_loss == "aepo_balanced_clip" else "PPO clip")
    dual = "no dual clip" if c == NO_DUAL_CLIP else f"dual clip c = {c}"
    return f"{shape}; eps_low = {low}, eps_high = {high}, {dual}"


def _loss_difference(t: Trained, ref: ReferenceSetting) -> str:
    if ref.clip_ratios[2] == NO_DUAL_CLIP and t.clip[2] != NO_DUAL_CLIP and t.clip[:2] == ref.clip_ratios[:2]:
        return ("the reference's loss has no dual clip; it changes only tokens with a negative advantage whose ratio "
                f"exceeds c = {t.clip[2]:g}, capping their loss at c |A|; -o rl.loss.clip_ratio_c=1e9 removes it")
    return "another loss or clip ratios"


AGGREGATION_TEXT = {
    "token_mean": "token mean over the mini-batch",
    "seq_mean_token_mean": "mean over sequences of their token means",
    "seq_mean_token_sum_norm": "mean over sequences of token sums / max_response_length (Dr. GRPO)",
    "micro_token_mean": "token mean per micro-batch x its share of the mini-batch's sequences (micro-batches of "
                        "micro_batch_size rows)",
}
REFERENCE_AGGREGATION = ("token mean per micro-batch x its share of the mini-batch's sequences (micro-batches "
                         "packed by tokens: use_dynamic_bsz)")


def _kl(t: Trained) -> str:
    if t.kl_coef == 0:
        return "none (coefficient 0)"
    return f"{t.kl_coef} x {t.kl_type}" + (" (low_var_kl: clamped to [-10, 10])" if t.kl_type == "k3" else "")


def training_rows(rl: RLSection, t: Trained, ref: ReferenceSetting) -> list[CardRow]:
    published = "off in effect: the flag is on, but entropy is computed only when entropy_coeff != 0 (0 in the " \
        "script), so no advantage is scaled" if ref.entropy_advantage_flag else "off"
    aware = _entropy_aware(rl)
    ref_loss = Trained("aepo_balanced_clip" if ref.balanced_clip else "ppo_dual_clip", ref.clip_ratios,
                       "", ref.kl_loss_coef, "k3", ref.entropy_coeff, "reference", "")
    size = ("per-token weights differ by (mean length in the mini-batch) / (mean length in the token's "
            "micro-batch), 0.70-1.25 on a one-GPU mini-batch; rl.loss.aggregation=micro_token_mean reproduces it "
            "(local engine)")
    return [
        _row("reward", t.reward, "reference", "math_equiv scores math answers by equivalence", "published-runs",
             note=f"the reference: {ref.reward_code}"),
        _row("advantage estimator", _advantage(rl), _advantage(rl.model_copy(update={"advantage": type(
            rl.advantage)()})), "another estimator or eps", "advantage"),
        _row("attribution of shared prefixes", rl.advantage.attribution, "soft",
             "hard attribution is the paper's alternative; the code has soft only", "advantage"),
        _row("entropy-aware advantage", aware, published, same=aware == "off",
             why="the paper's described method; the published AEPO run trained without it (set "
             "rl.advantage.entropy_aware=false to reproduce it)" if rl.advantage.entropy_scope == "step" else
             "the reference code's own computation, as it would run with entropy computed; the published run "
             "trained without it", anchor="entropy-aware-advantage"),
        _row("policy loss", _policy_loss(t), _policy_loss(ref_loss), _loss_difference(t, ref), "policy-loss"),
        _row("loss aggregation", AGGREGATION_TEXT.get(t.aggregation, t.aggregation), REFERENCE_AGGREGATION,
             size if t.aggregation == "token_mean" else "micro-batches of fixed row count, not token-packed"
             if t.aggregation == "micro_token_mean" else "another aggregation", "loss-aggregation"),
        _row("KL penalty", _kl(t), _kl(ref_loss), "a KL term the published runs do not have", "kl"),
        _row("entropy bonus", str(t.entropy_coef), str(ref.entropy_coeff), "an entropy bonus", "policy-loss"),
    ]


def card_notes(rl: RLSection) -> list[str]:
    """Settings that are valid but switch a mechanism off without saying so."""
    ro, spec, notes = rl.rollout, ALGORITHMS.get(rl.algorithm), []
    if spec.branches and ro.beam_size < 2:
        notes.append(f"rl.rollout.beam_size={ro.beam_size}: no copies are ever made ({rl.algorithm} samples like "
                     "GRPO plus fresh roots)")
    if spec.branches and ro.initial_rollouts >= ro.n and not ro.dynamic_rollouts:
        notes.append(f"rl.rollout.initial_rollouts = n = {ro.n}: no budget is left for copies")
    if rl.optim.lr == 0:
        notes.append("rl.optim.lr=0: the weights never change (a control run: the SFT policy through RL's path)")
    if spec.governs("rollout.branch_penalty") and ro.branch_penalty * 1 >= 1:
        notes.append(f"rl.rollout.branch_penalty={ro.branch_penalty}: the factor is 0 from c = 1 on")
    return notes


def tool_pool_row(agent: AgentSection, ref: ReferenceSetting) -> CardRow:
    """The tool threads of one rollout worker (agent.concurrency) against the reference's pool."""
    return _row("tool threads per rollout worker", str(agent.concurrency), ref.tool_threads,
                "fewer threads queue a round's calls (timing/tool_queue_s; `arpo plan` says when a step is "
                "tool-bound); agent.concurrency sets it", "tool-pool",
                note="infrastructure: it changes a step's time, not what is trained")


def algorithm_card(rl: RLSection, agent: AgentSection | None = None) -> AlgorithmCard:
    """The card of `rl`; with the run's `agent` section, its tool pool's row too."""
    ref = reference_for(rl.algorithm, rl.reference_setting)
    trained = TRAINED.get(rl.engine)(rl)
    engine = CardRow("engine", f"{rl.engine}: {trained.source}", f"{ref.code}: {ref.fork}",
                     "differs", "infrastructure only: the algorithm functions are the same objects in both engines",
                     f"{DOC}#published-runs")
    return AlgorithmCard(rl.algorithm, rl.engine, ref,
                         [engine, *rollout_rows(rl.algorithm, rl.rollout, ref), *training_rows(rl, trained, ref),
                          *([tool_pool_row(agent, ref)] if agent is not None else [])],
                         card_notes(rl))


def card_table(card: AlgorithmCard) -> list[dict[str, str]]:
    return [{"mechanism": r.mechanism, "this run": r.value, "reference": r.reference, "verdict": r.verdict,
             "why": r.why, "link": r.link} for r in card.rows]


def card_markdown(card: AlgorithmCard) -> str:
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = [f"# Algorithm card: {card.algorithm} on the {card.engine} engine",
             "", f"Compared with the published run `{card.reference.name}`: {card.reference.code}, "
             f"{card.reference.script}.", "",
             "| mechanism | this run | reference | verdict | why |", "|---|---|---|---|---|"]
    lines += [f"| {r.mechanism} | {cell(r.value)} | {cell(r.reference)} | {r.verdict} | {cell(r.why)} |"
              for r in card.rows]
    if card.notes:
        lines += ["", "Notes:", *[f"- {note}" for note in card.notes]]
    differs = sum(r.verdict == "differs" for r in card.rows)
    lines += ["", f"{differs} of {len(card.rows)} rows differ from the reference; facts and links: {DOC}.", ""]
    return "\n".join(lines)
