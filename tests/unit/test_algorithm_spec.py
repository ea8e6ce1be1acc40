"""The algorithm table (stages/core/algorithm_spec.py): a new algorithm is one line (plus its branch rule, when it has
a new one), and the config, the RL stage, the rollout and the algorithm card read what each algorithm turns on from
the table alone. The engine table (stages/core/engine_spec.py) likewise says what each RL engine can do."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from stages.core.algorithm_spec import (
    ALGORITHMS,
    SPECS,
    AlgorithmSpec,
    Component,
    Setting,
    algorithm_table,
    foreign_settings,
)
from stages.core.config.loader import ConfigError, load_config
from stages.core.config.rl import RolloutSection
from stages.core.env import PROJECT_ROOT
from stages.core.registry import find_registry

# a made-up algorithm: a tree with a plain branch rule, the entropy-aware advantage (also AEPO's) and a KL penalty
XPO = AlgorithmSpec(name="xpo", growth="tree", reference="arpo-qwen2.5-7b-reasoning", branch_rule="threshold",
                    components=(Component("entropy-aware advantage", Setting("advantage.entropy_aware", True)),
                                Component("KL penalty", Setting("loss.kl_coef", 0.01, positive=True))),
                    options=(Setting("rollout.dynamic_rollouts", True),))


def rl(policy_loss="ppo_dual_clip", entropy_aware=False, branch_penalty=0.0, kl_coef=0.0, dynamic=False,
       scope="step"):
    """An RL section's values as the table reads them (dotted keys under rl)."""
    return SimpleNamespace(loss=SimpleNamespace(policy_loss=policy_loss, kl_coef=kl_coef),
                           advantage=SimpleNamespace(entropy_aware=entropy_aware, entropy_scope=scope),
                           rollout=SimpleNamespace(branch_penalty=branch_penalty, dynamic_rollouts=dynamic))


def test_an_extra_line_derives_its_defaults_components_and_foreign_settings() -> None:
    table = algorithm_table((*SPECS, XPO))
    assert table.ordered() == ["grpo", "arpo", "aepo", "xpo"] and table.get("xpo").branches
    assert XPO.implied() == {"advantage": {"entropy_aware": True}, "loss": {"kl_coef": 0.01}}
    assert XPO.components_off(rl(entropy_aware=True, kl_coef=0.05)) == []     # any positive weight is on
    assert XPO.components_off(rl(entropy_aware=True)) == ["KL penalty"]
    # a setting two algorithms own is foreign only to the others; each owner is named with its settings
    assert foreign_settings(table, "xpo", rl(entropy_aware=True, kl_coef=0.01)) == {}
    assert foreign_settings(table, "arpo", rl(entropy_aware=True, kl_coef=0.01, dynamic=True)) == {
        "aepo": ["rl.advantage.entropy_aware=true", "rl.rollout.dynamic_rollouts=true"],
        "xpo": ["rl.advantage.entropy_aware=true", "rl.loss.kl_coef=0.01", "rl.rollout.dynamic_rollouts=true"]}
    assert foreign_settings(table, "xpo", rl(policy_loss="aepo_balanced_clip")) == {
        "aepo": ["rl.loss.policy_loss=aepo_balanced_clip"]}


def threshold_decide(ro, u, dh, c):
    return u <= ro.branch_probability


def threshold_probability(ro, dh, c):
    return ro.branch_probability


@pytest.fixture
def with_xpo(monkeypatch):
    """XPO's line in the table and its only code: the new branch rule it names, with its formula."""
    from stages.rl.strategies import BRANCH_RULES, BranchRule

    monkeypatch.setitem(ALGORITHMS._entries, "xpo", XPO)
    monkeypatch.setitem(BRANCH_RULES._entries, "threshold", BranchRule("u <= tau", threshold_decide,
                                                                       threshold_probability))


def test_the_config_stage_rollout_and_card_follow_an_extra_line(with_xpo) -> None:
    from stages.rl.card import algorithm_card
    from stages.rl.stage import components_off
    from stages.rl.strategies import get_strategy

    cfg = load_config("tiny-cpu", ["rl.algorithm=xpo"]).rl
    assert (cfg.advantage.entropy_aware, cfg.loss.kl_coef, cfg.loss.policy_loss) == (True, 0.01, "ppo_dual_clip")
    strategy = get_strategy("xpo", cfg.rollout)   # built from the line: a tree with the rule it names, no probe
    assert components_off(cfg) == [] and strategy.branching and not strategy.probe
    assert strategy.should_branch(0.4, 0.0, 0) and not strategy.should_branch(0.6, 0.0, 0)  # tau 0.5 (default)
    assert components_off(load_config("tiny-cpu", ["rl.algorithm=xpo", "rl.loss.kl_coef=0"]).rl) == ["KL penalty"]
    card = {r.mechanism: r.value for r in algorithm_card(cfg).rows}
    assert card["branch rule"] == "branch iff u <= tau; tau = 0.5" and card["penalty counter c"] == "none"
    # its settings are now foreign to the other algorithms, with the fix
    with pytest.raises(ConfigError, match="rl.loss.kl_coef=0.1: XPO setting.*Set rl.algorithm=xpo"):
        load_config("tiny-cpu", ["rl.loss.kl_coef=0.1"])


# hand-derived from the reference scripts (docs/reference.md "Published runs"), not read from the table
IMPLIED = {"grpo": {}, "arpo": {},
           "aepo": {"loss": {"policy_loss": "aepo_balanced_clip"}, "advantage": {"entropy_aware": True},
                    "rollout": {"branch_penalty": 0.05}}}
RULES = {"grpo": "none", "arpo": "branch iff clip(u - w dH, 0, 1) <= tau; tau = 0.5, w = 0.2",
         "aepo": "branch iff clip((u + w dH) max(0, 1 - p c), 0, 1) >= tau; tau = 0.5, w = 0.2, p = 0.05"}


@pytest.mark.parametrize("algo", ["grpo", "arpo", "aepo"])
def test_config_stage_rollout_and_card_agree_with_the_table(algo: str) -> None:
    from stages.rl.card import algorithm_card
    from stages.rl.reference_code import reference_for
    from stages.rl.stage import components_off
    from stages.rl.strategies import get_strategy

    spec = ALGORITHMS.get(algo)
    assert spec.implied() == IMPLIED[algo]
    cfg = load_config("tiny-cpu", [f"rl.algorithm={algo}"]).rl
    aepo = algo == "aepo"
    assert (cfg.loss.policy_loss, cfg.advantage.entropy_aware, cfg.rollout.branch_penalty) == \
        (("aepo_balanced_clip", True, 0.05) if aepo else ("ppo_dual_clip", False, 0.0))
    assert components_off(cfg) == []
    off = load_config("tiny-cpu", [f"rl.algorithm={algo}", "rl.advantage.entropy_aware=false"]).rl
    assert components_off(off) == (["entropy-aware advantage"] if aepo else [])
    strategy = get_strategy(algo, cfg.rollout)
    assert strategy.branching == strategy.fill_fresh == (algo != "grpo")
    assert strategy.initial_rollouts() == (cfg.rollout.n if algo == "grpo" else cfg.rollout.initial_rollouts)
    card = {r.mechanism: r.value for r in algorithm_card(cfg).rows}
    assert card["rollout strategy"] == algo and card["branch rule"] == RULES[algo]
    assert card["penalty counter c"].startswith("c = consecutive") == aepo
    assert ("entropy window" in card) == (algo != "grpo")
    assert reference_for(algo).algorithm == algo


def test_every_line_has_its_own_code_registered() -> None:
    from stages.rl.strategies import BRANCH_RULES

    assert ALGORITHMS.names() == ["aepo", "arpo", "grpo"]
    assert {s.branch_rule for s in ALGORITHMS.values() if s.branches} <= set(BRANCH_RULES.names())
    assert [s.branch_rule for s in ALGORITHMS.values() if not s.branches] == [""]  # GRPO names none
    assert find_registry("algorithm") is ALGORITHMS  # rl.algorithm names a line of the table
    registries = {"loss.policy_loss": "policy loss"}
    for spec in ALGORITHMS.values():
        for setting in spec.settings:
            if setting.key in registries:  # a loss it implies is registered by that name
                find_registry(registries[setting.key]).get(setting.value)
    assert "strategy" not in RolloutSection.model_fields


def test_the_engine_table_answers_what_each_engine_can_do() -> None:
    from stages.core.config.rl import RLSection
    from stages.core.engine_spec import ENGINES
    from stages.cost.estimate import devices
    from stages.rl.card import TRAINED
    from stages.rl.engines import RL_ENGINES

    assert ENGINES.names() == RL_ENGINES.names() == TRAINED.names() == ["local", "verl"]  # each line has its code
    local, verl = ENGINES.get("local"), ENGINES.get("verl")
    # by hand: verl spans nnodes x GPUs per node (2 x 8 = 16), the local engine one device
    rl = RLSection(engine="verl", verl={"nnodes": 2, "n_gpus_per_node": 8})
    assert verl.devices(rl) == 16 and local.devices(rl) == 1
    assert devices(load_config("arpo-qwen2.5-7b-reasoning", [])) == 8
    assert (verl.package, verl.priced, local.package, local.version, local.priced) == ("verl", True, "", "", False)
    # the version the line names is the one the requirements files pin (they install it; the line states it to code)
    pins = {f: re.findall(r"^verl(?:\[[\w,]+\])?==(\S+)", (PROJECT_ROOT / "requirements" / f).read_text(), re.M)
            for f in ("verl-gpu.txt", "verl-test.txt")}
    assert pins == {"verl-gpu.txt": [verl.version], "verl-test.txt": [verl.version]}
    # docs/reference.md's sources name it once: the version every verl file:line in docs/ was read from
    assert f"| verl {verl.version} | the pinned package" in (PROJECT_ROOT / "docs" / "reference.md").read_text()
    # a setting an engine cannot run is refused by its line when the config loads, with the fix
    with pytest.raises(ConfigError, match="entropy_scope=micro_batch runs on the local engine only"):
        load_config("arpo-qwen2.5-7b-reasoning", ["rl.algorithm=aepo", "rl.advantage.entropy_scope=micro_batch"])
    assert load_config("tiny-cpu", ["rl.algorithm=aepo", "rl.advantage.entropy_scope=micro_batch"]).rl.engine == \
        "local"
    off = RLSection(engine="verl").model_copy(update={"trainer": RLSection().trainer.model_copy(
        update={"old_logprobs": "rollout"})})
    assert verl.refused(off) == [verl.refuses[1].why] and local.refused(off) == []
