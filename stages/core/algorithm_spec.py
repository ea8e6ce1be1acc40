"""The RL algorithms, one line each: what each turns on. Every other statement of it is derived from this table.

Read by the config (stages/core/config/rl.py: the defaults `rl.algorithm` implies where a config leaves a key unset,
and the settings only another algorithm may turn on), the RL stage (stages/rl/stage.py: the components a config
switches off, an ablation), the rollout (stages/rl/strategies.py: independent samples or a tree) and the algorithm
card (stages/rl/card.py: its growth, branch rule and penalty rows, the published run it compares with).

    spec = ALGORITHMS.get(cfg.rl.algorithm)
    spec.implied()                     # {"loss": {"policy_loss": "aepo_balanced_clip"}, ...}
    spec.components_off(cfg.rl)        # ["branch penalty"] when a config sets rl.rollout.branch_penalty=0

Adding an algorithm: one line here. The rollout strategy is built from the line (stages/rl/strategies.py
`get_strategy`: its growth, the branch rule it names, whether it owns the entropy probe); only a new branch rule
(registered in BRANCH_RULES there, its formula beside its code), a new loss or estimator it implies (registered by
name) or a new published run to compare with (stages/rl/reference_code.py) needs code of its own. This module is
pure data: it imports no config model and no stage code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Any, Literal

from stages.core.registry import Registry

Growth = Literal["independent", "tree"]


@dataclass(frozen=True)
class Setting:
    """One value under `rl`, by its dotted key below it ("loss.policy_loss"). It counts as on when it equals
    `value`, or, for a `positive` setting (a weight a config may tune), when it is above 0."""

    key: str
    value: Any
    positive: bool = False

    def is_on(self, value: Any) -> bool:
        return value > 0 if self.positive else value == self.value

    def text(self, value: Any) -> str:
        """`rl.<key>=<value>` as written in an override."""
        shown = str(value).lower() if isinstance(value, bool) else value
        return f"rl.{self.key}={shown}"


@dataclass(frozen=True)
class Component:
    """A mechanism the algorithm turns on: its setting's value fills the key where a config leaves it unset (or
    null); a config may switch it off explicitly, an ablation the run's artifacts name."""

    name: str
    setting: Setting


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """name: `rl.algorithm`. growth: independent samples from the prompt, or an entropy-guided tree (branching
    copies and fresh roots). branch_rule: the name of its branch rule in stages/rl/strategies.py BRANCH_RULES
    (its code and the formula the card states; "" for independent samples). components: what it turns on by default.
    options: settings off by default that only this algorithm may turn on. reference: the published run the card
    compares with unless rl.reference_setting names another."""

    name: str
    growth: Growth
    reference: str
    branch_rule: str = ""
    components: tuple[Component, ...] = ()
    options: tuple[Setting, ...] = ()

    @property
    def branches(self) -> bool:
        return self.growth == "tree"

    @property
    def settings(self) -> tuple[Setting, ...]:
        """Every setting the algorithm owns: its components' and its options."""
        return (*(c.setting for c in self.components), *self.options)

    def governs(self, key: str) -> bool:
        return any(s.key == key for s in self.settings)

    def implied(self) -> dict[str, dict[str, Any]]:
        """{subsection: {key: value}} the algorithm sets where a config leaves a key unset."""
        out: dict[str, dict[str, Any]] = {}
        for c in self.components:
            section, _, key = c.setting.key.rpartition(".")
            out.setdefault(section, {})[key] = c.setting.value
        return out

    def components_off(self, rl: Any) -> list[str]:
        """The components a config (the RL section) switches off: an ablation of this algorithm."""
        return [c.name for c in self.components if not c.setting.is_on(value_at(rl, c.setting.key))]


def value_at(rl: Any, key: str) -> Any:
    """The value at dotted `key` of the RL section (`loss.policy_loss`)."""
    return reduce(getattr, key.split("."), rl)


# AEPO as the reference AEPO script runs it (docs/reference.md "Published runs"): entropy-balanced clipping and the
# entropy-aware advantage on, the consecutive-branch penalty 0.05, dynamic rollouts (entropy pre-monitoring) off.
SPECS: tuple[AlgorithmSpec, ...] = (
    AlgorithmSpec(name="grpo", growth="independent", reference="grpo-qwen2.5-7b-reasoning"),
    AlgorithmSpec(name="arpo", growth="tree", reference="arpo-qwen2.5-7b-reasoning", branch_rule="arpo"),
    AlgorithmSpec(
        name="aepo", growth="tree", reference="aepo-qwen3-14b-deepsearch", branch_rule="aepo",
        components=(Component("entropy-balanced clipping", Setting("loss.policy_loss", "aepo_balanced_clip")),
                    Component("entropy-aware advantage", Setting("advantage.entropy_aware", True)),
                    Component("branch penalty", Setting("rollout.branch_penalty", 0.05, positive=True))),
        options=(Setting("rollout.dynamic_rollouts", True), Setting("advantage.entropy_scope", "micro_batch"))),
)


def algorithm_table(specs: tuple[AlgorithmSpec, ...]) -> Registry[AlgorithmSpec]:
    """The registry `rl.algorithm` names (a typo fails with the nearest name), in table order."""
    return Registry("algorithm", {spec.name: spec for spec in specs})


def foreign_settings(table: Registry[AlgorithmSpec], algorithm: str, rl: Any) -> dict[str, list[str]]:
    """{owner: ["rl.<key>=<value>", ...]}: settings that `rl` turns on and only another algorithm owns."""
    own = table.get(algorithm)
    found: dict[str, list[str]] = {}
    for spec in table.values():
        for s in spec.settings:
            if spec.name != algorithm and not own.governs(s.key) and s.is_on(value := value_at(rl, s.key)):
                found.setdefault(spec.name, []).append(s.text(value))
    return found


ALGORITHMS: Registry[AlgorithmSpec] = algorithm_table(SPECS)

__all__ = ["ALGORITHMS", "SPECS", "AlgorithmSpec", "Component", "Growth", "Setting", "algorithm_table",
           "foreign_settings", "value_at"]
