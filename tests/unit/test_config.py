"""Every shipped YAML validates; bad keys fail early with the key and the fix; overrides parse as YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stages.core.config.loader import (
    CONFIG_DIR,
    ConfigError,
    load_config,
    parse_override,
    profile_names,
    read_yaml,
    to_yaml,
    validate,
)


@pytest.mark.parametrize("profile", profile_names())
def test_every_profile_validates(profile: str) -> None:
    config = load_config(profile)
    assert config.profile == profile
    # the resolved config round-trips through YAML unchanged
    assert validate({**read_yaml_text(to_yaml(config))}) == config


def read_yaml_text(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_every_yaml_under_configs_parses() -> None:
    files = [p for p in CONFIG_DIR.rglob("*.y*ml")]
    assert len([p for p in files if p.parent.name == "profiles"]) >= 4
    for path in files:
        assert isinstance(read_yaml(path), dict), path


def test_expected_profiles_exist() -> None:
    assert {"tiny-cpu", "arpo-qwen2.5-7b-reasoning", "arpo-qwen3-14b-deepsearch",
            "aepo-qwen3-14b-deepsearch"} <= set(profile_names())


def test_paper_profiles_carry_reference_hyperparameters() -> None:
    arpo7b = load_config("arpo-qwen2.5-7b-reasoning")
    assert (arpo7b.rl.rollout.n, arpo7b.rl.rollout.initial_rollouts, arpo7b.rl.rollout.beam_size) == (16, 8, 2)
    assert (arpo7b.rl.trainer.train_batch_size, arpo7b.rl.trainer.ppo_mini_batch_size) == (128, 16)
    assert (arpo7b.rl.rollout.max_prompt_length, arpo7b.rl.rollout.max_response_length) == (1536, 4096)
    assert arpo7b.rl.optim.lr == 1e-6 and arpo7b.sft.learning_rate == 7e-6 and arpo7b.sft.cutoff_len == 15000
    aepo = load_config("aepo-qwen3-14b-deepsearch")
    assert (aepo.rl.rollout.n, aepo.rl.rollout.initial_rollouts, aepo.rl.rollout.call_limit) == (12, 6, 6)
    assert aepo.rl.loss.policy_loss == "aepo_balanced_clip" and aepo.rl.advantage.entropy_aware
    assert aepo.rl.rollout.branch_penalty == 0.05


def test_typo_names_the_key_and_the_nearest_valid_one() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", ["rl.rollout.beam_sise=3"])
    assert "'rl.rollout.beam_sise'" in str(err.value)
    assert "did you mean 'rl.rollout.beam_size'" in str(err.value)


def test_unknown_section_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'trainr'.*did you mean 'train'|unknown config key 'trainr'"):
        load_config("tiny-cpu", ["trainr.steps=3"])


def test_unknown_key_in_a_yaml_file_fails(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "bad.yaml").write_text("sft:\n  learning_rat: 1.0e-5\n")
    with pytest.raises(ConfigError, match="'sft.learning_rat'.*'sft.learning_rate'"):
        load_config("bad", config_dir=tmp_path)


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ConfigError, match="rl.rollout.n"):
        load_config("tiny-cpu", ["rl.rollout.n=many"])


def test_cross_field_rule_says_how_to_fix() -> None:
    with pytest.raises(ConfigError, match="initial_rollouts=9 exceeds rl.rollout.n=4"):
        load_config("tiny-cpu", ["rl.rollout.initial_rollouts=9"])


def test_unknown_profile_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'tiny-cpu'"):
        load_config("tiny-cp")


@pytest.mark.parametrize("text,expected", [
    ("rl.rollout.n=8", (["rl", "rollout", "n"], 8)),
    ("rl.optim.lr=1e-5", (["rl", "optim", "lr"], "1e-5")),        # YAML 1.1: no dot -> string, pydantic coerces
    ("eval.benchmarks=[gsm8k, hotpotqa]", (["eval", "benchmarks"], ["gsm8k", "hotpotqa"])),
    ("sft.enabled=false", (["sft", "enabled"], False)),
    ("run.name=my run", (["run", "name"], "my run")),
])
def test_override_values_parse_as_yaml(text: str, expected: tuple) -> None:
    assert parse_override(text) == expected


def test_overrides_apply_and_config_is_frozen() -> None:
    config = load_config("tiny-cpu", ["rl.rollout.n=8", "rl.optim.lr=1e-5", "eval.benchmarks=[gsm8k]"])
    assert config.rl.rollout.n == 8 and config.rl.optim.lr == 1e-5 and config.eval.benchmarks == ["gsm8k"]
    with pytest.raises(ValidationError, match="frozen"):
        config.rl.rollout.n = 3  # type: ignore[misc]


def test_override_without_equals_is_explained() -> None:
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config("tiny-cpu", ["rl.rollout.n"])


def test_section_hash_changes_only_with_that_section() -> None:
    from stages.core.fingerprint import hash_value

    # a stage key hashes its own sections: an RL override must leave the SFT section's hash alone
    a = load_config("tiny-cpu")
    b = load_config("tiny-cpu", ["rl.rollout.n=8"])
    assert hash_value(a.sft) == hash_value(b.sft)
    assert hash_value(a.rl) != hash_value(b.rl)


def test_algorithm_is_the_one_source_of_the_rollout_strategy() -> None:
    grpo = load_config("tiny-cpu", ["rl.algorithm=grpo"])
    assert (grpo.rl.algorithm, grpo.rl.loss.policy_loss, grpo.rl.rollout.branch_penalty) == \
        ("grpo", "ppo_dual_clip", 0.0)
    # the reference AEPO script (docs/reference.md "Published runs"): balanced clipping on, entropy-aware advantage
    # on, dynamic rollouts off; branch penalty 0.05 (issue #44: (u + w dH)(1 - 0.05 c))
    aepo = load_config("tiny-cpu", ["rl.algorithm=aepo"])
    assert (aepo.rl.algorithm, aepo.rl.rollout.branch_penalty, aepo.rl.loss.policy_loss,
            aepo.rl.advantage.entropy_aware, aepo.rl.rollout.dynamic_rollouts) == \
        ("aepo", 0.05, "aepo_balanced_clip", True, False)
    assert "strategy" not in type(aepo.rl.rollout).model_fields  # no second key to agree with rl.algorithm
    # null on a component's key is the algorithm's default, whichever algorithm an override picks
    nulls = ["rl.rollout.branch_penalty=null", "rl.loss.policy_loss=null", "rl.advantage.entropy_aware=null"]
    assert load_config("tiny-cpu", ["rl.algorithm=aepo", *nulls]) == aepo
    assert load_config("tiny-cpu", ["rl.algorithm=grpo", *nulls]) == grpo


@pytest.mark.parametrize("value", ["grpo", "aepo"])
def test_rollout_strategy_is_no_key_and_names_the_fix(value) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [f"rl.rollout.strategy={value}"])
    assert "config key 'rl.rollout.strategy' was removed" in str(err.value)
    assert f"set rl.algorithm instead (rl.algorithm={value})" in str(err.value)


@pytest.mark.parametrize("overrides,fix", [
    (["rl.loss.policy_loss=aepo_balanced_clip"], "aepo_balanced_clip: AEPO setting.*Set rl.algorithm=aepo"),
    (["rl.algorithm=grpo", "rl.advantage.entropy_aware=true", "rl.rollout.branch_penalty=0.05"],
     "entropy_aware=true, rl.rollout.branch_penalty=0.05: AEPO setting.*rl.algorithm=grpo"),
    (["rl.rollout.dynamic_rollouts=true"], "dynamic_rollouts=true: AEPO setting"),
    (["rl.advantage.entropy_scope=micro_batch"], "entropy_scope=micro_batch: AEPO setting"),
    (["rl.algorithm=aepo", "rl.advantage.entropy_aware=false", "rl.advantage.entropy_scope=micro_batch"],
     "entropy_aware=false turns off; remove one"),
    # the reference's #42 class (initial roots above the budget crashed its rollout): refused here
    (["rl.rollout.initial_rollouts=9", "rl.rollout.n=8"], "initial_rollouts=9 exceeds rl.rollout.n=8"),
])
def test_contradicting_algorithm_settings_fail_with_the_fix(overrides, fix) -> None:
    with pytest.raises(ConfigError, match=fix) as err:
        load_config("tiny-cpu", overrides)
    assert "got {" not in str(err.value)  # the message, not a dump of the section


def test_aepo_component_switched_off_is_an_ablation() -> None:
    from stages.rl.stage import components_off

    cfg = load_config("aepo-qwen3-14b-deepsearch", ["rl.rollout.branch_penalty=0", "rl.loss.policy_loss=ppo_dual_clip"])
    assert cfg.rl.rollout.branch_penalty == 0.0 and cfg.rl.advantage.entropy_aware
    assert components_off(cfg.rl) == ["entropy-balanced clipping", "branch penalty"]
    assert components_off(load_config("aepo-qwen3-14b-deepsearch").rl) == []


@pytest.mark.parametrize("overrides,fix", [
    (["rl.loss.aggregation=micro_token_mean"], "micro_token_mean .*local engine only.*Use aggregation=token_mean"),
    (["rl.advantage.entropy_scope=micro_batch"], "entropy_scope=micro_batch runs on the local engine only"),
    (["rl.trainer.old_logprobs=rollout", "rl.advantage.entropy_aware=false"],
     "old_logprobs=rollout runs on the local engine only"),
])
def test_local_engine_only_settings_are_refused_under_verl(overrides, fix) -> None:
    with pytest.raises(ConfigError, match=fix):
        load_config("aepo-qwen3-14b-deepsearch", overrides)
    assert load_config("tiny-cpu", ["rl.algorithm=aepo", *overrides]).rl.engine == "local"  # fine locally


def test_generation_settings_carry_the_rollout_sections_values() -> None:
    import dataclasses

    from stages.core.config.rl import RolloutSection

    section = RolloutSection(n=4, initial_rollouts=4, temperature=0.7, top_k=5, kv_reuse=False,
                             max_response_length=64, prompt_overflow="skip")
    settings = section.generation()
    # every field generation reads is the section's own value, by name (no default restated elsewhere)
    assert {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)} == \
        {f.name: getattr(section, f.name) for f in dataclasses.fields(settings)}
    assert (settings.n, settings.temperature, settings.top_k, settings.kv_reuse, settings.prompt_overflow) == \
        (4, 0.7, 5, False, "skip")
