"""One source per fact in the config: defaults live in the models, profiles state what differs (`extends:` to build
on another), and names a registry holds are checked against that registry, never a Literal copy of it."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from stages.core.config.loader import (
    CONFIG_DIR,
    ConfigError,
    RunConfig,
    deep_merge,
    load_config,
    profile_names,
    read_profile,
    read_yaml,
)
from stages.core.config.names import registry_fields
from stages.core.config.profile_diff import restated_keys
from stages.core.registry import find_registry, registry_kinds


def _leaves(data: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_there_is_no_second_home_for_defaults() -> None:
    assert not (CONFIG_DIR / "base.yaml").exists()
    assert RunConfig().run.name == "run"  # the value base.yaml used to disagree on


@pytest.mark.parametrize("name", profile_names())
def test_no_profile_restates_a_default_or_what_it_extends(name: str) -> None:
    restated = restated_keys(name)
    assert not restated, (f"configs/profiles/{name}.yaml restates {restated}: each has the value it would have "
                          "without the key (the model default, what rl.algorithm implies, or what `extends` gives); "
                          "remove them (`arpo config show --diff` lists what the profile changes)")


def test_a_restated_key_is_found_whether_default_implied_or_inherited(tmp_path: Path) -> None:
    _write(tmp_path, "base", "rl:\n  rollout: {n: 8, initial_rollouts: 4}\n")
    # by hand: rl.optim.lr 1e-6 is OptimSection's default; branch_penalty 0.05 is what algorithm aepo implies
    # (stages/core/algorithm_spec.py); rollout.n 8 is base's; initial_rollouts 2 and the algorithm change something
    _write(tmp_path, "leaf", "extends: base\nrl:\n  algorithm: aepo\n  optim: {lr: 1.0e-6}\n"
                             "  rollout: {n: 8, initial_rollouts: 2, branch_penalty: 0.05}\n")
    assert restated_keys("leaf", tmp_path) == ["rl.optim.lr", "rl.rollout.n", "rl.rollout.branch_penalty"]
    assert restated_keys("base", tmp_path) == []


def test_config_show_diff_prints_what_a_profile_changes(tmp_path: Path, capsys) -> None:
    from flows.cli import main

    _write(tmp_path, "base", "run: {name: base-run}\nrl:\n  rollout: {n: 8, initial_rollouts: 4}\n")
    _write(tmp_path, "leaf", "extends: base.yaml\nrl:\n  algorithm: aepo\n  optim: {lr: 1.0e-6}\n")
    assert main(["config", "show", "--diff", "-p", str(tmp_path / "profiles" / "leaf.yaml"),
                 "-o", "rl.rollout.call_limit=2"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    # by hand: base's name and rollout sizes, leaf's algorithm, the override, and what aepo implies (the branch
    # penalty, the balanced-clip loss, the entropy-aware advantage); lr equals its default, so it is no change
    assert set(rows) == {"run.name", "rl.rollout.n", "rl.rollout.initial_rollouts", "rl.algorithm",
                         "rl.rollout.call_limit", "rl.rollout.branch_penalty", "rl.loss.policy_loss",
                         "rl.advantage.entropy_aware"}
    assert rows["rl.rollout.n"].split()[1:] == ["8", "(default", "16;", "extends", "base)"]
    assert rows["rl.algorithm"].endswith("(default arpo; profile)")
    assert rows["rl.rollout.call_limit"].endswith("(default 3; -o)")
    assert rows["rl.loss.policy_loss"].endswith("(default ppo_dual_clip; implied)")
    main(["config", "show", "--diff", "-p", "aepo-qwen3-14b-deepsearch"])
    out = capsys.readouterr().out
    assert out.startswith("# aepo-qwen3-14b-deepsearch: ") and "restated" not in out
    assert "rl.rollout.n  " in out and "(default 16; extends arpo-qwen3-14b-deepsearch)" in out


def test_aepo_deepsearch_is_the_arpo_deepsearch_run_with_the_algorithm_switched() -> None:
    arpo = load_config("arpo-qwen3-14b-deepsearch").model_dump(mode="json")
    aepo = load_config("aepo-qwen3-14b-deepsearch").model_dump(mode="json")
    differs = {key for key, value in _leaves(aepo).items() if _leaves(arpo)[key] != value}
    # by hand: the run's name and profile, the algorithm and what it implies (loss, entropy-aware
    # advantage, branch penalty 0.05), and the published settings both cards and reports compare with
    assert differs == {"profile", "run.name", "rl.algorithm", "rl.reference_setting",
                       "rl.rollout.branch_penalty", "rl.loss.policy_loss", "rl.advantage.entropy_aware",
                       "eval.reference_setting"}
    assert len(read_yaml(CONFIG_DIR / "profiles" / "aepo-qwen3-14b-deepsearch.yaml")) == 4  # extends run rl eval


def _write(folder: Path, name: str, text: str) -> None:
    (folder / "profiles").mkdir(exist_ok=True)
    (folder / "profiles" / f"{name}.yaml").write_text(text)


def test_extends_merges_mappings_and_replaces_lists_along_a_chain(tmp_path: Path) -> None:
    _write(tmp_path, "base", "rl:\n  rollout: {n: 8, initial_rollouts: 4}\neval:\n  benchmarks: [gsm8k, hotpotqa]\n")
    _write(tmp_path, "mid", "extends: base\nrl:\n  rollout: {n: 6}\n")
    _write(tmp_path, "leaf", "extends: mid\neval:\n  benchmarks: [aime24]\n")
    cfg = load_config("leaf", config_dir=tmp_path)
    assert (cfg.profile, cfg.rl.rollout.n, cfg.rl.rollout.initial_rollouts) == ("leaf", 6, 4)
    assert cfg.eval.benchmarks == ["aime24"]  # a list replaces, it does not append
    assert read_profile(tmp_path / "profiles" / "leaf.yaml", tmp_path) == deep_merge(
        {"rl": {"rollout": {"n": 6, "initial_rollouts": 4}}, "eval": {"benchmarks": ["gsm8k", "hotpotqa"]}},
        {"eval": {"benchmarks": ["aime24"]}})


def test_extends_by_path_relative_to_the_extending_file(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "parent.yaml").write_text("rl:\n  rollout: {n: 12}\n")
    (tmp_path / "mine" / "child.yaml").write_text("extends: parent.yaml\nrl:\n  optim: {lr: 2.0e-6}\n")
    cfg = load_config(str(tmp_path / "mine" / "child.yaml"))
    assert (cfg.rl.rollout.n, cfg.rl.optim.lr, cfg.profile) == (12, 2e-6, "child")


@pytest.mark.parametrize("files,match", [
    ({"a": "extends: b\n", "b": "extends: a\n"}, r"extends 'a' makes a cycle \(a -> b -> a\)"),
    ({"a": "extends: tiny-cp\n", "tiny-cpu": "{}\n"}, "no profile 'tiny-cp'.*Did you mean 'tiny-cpu'"),
    ({"a": "extends: [b, c]\n"}, "extends must name one profile"),
])
def test_bad_extends_names_the_file_and_the_fix(tmp_path: Path, files: dict[str, str], match: str) -> None:
    for name, text in files.items():
        _write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=match):
        load_config("a", config_dir=tmp_path)


@pytest.mark.parametrize("override,message", [
    ("rl.loss.policy_loss=ppo_dual", "rl.loss.policy_loss: unknown policy loss 'ppo_dual'. Did you mean "
                                     "'ppo_dual_clip'?"),
    ("rl.algorithm=arpoo", "rl.algorithm: unknown algorithm 'arpoo'. Did you mean 'arpo'?"),
    ("rl.engine=verll", "rl.engine: unknown RL engine 'verll'. Did you mean 'verl'?"),
    ("rl.loss.aggregation=token_means", "rl.loss.aggregation: unknown loss aggregation 'token_means'. Did you mean "
                                        "'token_mean'?"),
    ("eval.benchmarks=[gsm8k, hotpotq]", "eval.benchmarks: unknown benchmark 'hotpotq'. Did you mean 'hotpotqa'?"),
    ("agent.cache.tools=[serch]", "agent.cache.tools: unknown tool 'serch'. Did you mean 'search'?"),
    ("agent.search.backend=locl", "agent.search.backend: unknown search backend 'locl'. Did you mean 'local'?"),
    ("eval.judge.serve.backend=extrnal", "eval.judge.serve.backend: unknown serving backend 'extrnal'"),
    ("sft.dpo.reward=math_eq", "sft.dpo.reward: unknown reward function 'math_eq'. Did you mean 'math_equiv'?"),
    ("rl.reference_setting=arpo-qwen3-14b", "rl.reference_setting: unknown reference setting 'arpo-qwen3-14b'"),
])
def test_a_name_no_registry_holds_fails_naming_the_key_and_the_nearest(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [override])
    assert message in str(err.value) and "Known: [" in str(err.value)


def test_a_registered_name_that_is_not_the_default_loads() -> None:
    cfg = load_config("tiny-cpu", ["rl.trainer.reward=math_equiv", "eval.benchmarks=[gsm8k, synthetic]",
                                   "rl.loss.aggregation=seq_mean_token_mean"])
    assert (cfg.rl.trainer.reward, cfg.rl.loss.aggregation) == ("math_equiv", "seq_mean_token_mean")


def _registry_fields() -> dict[str, tuple[type[BaseModel], str, str]]:
    """dotted key -> (section model, field, kind)."""
    out = {}
    for key, kind in registry_fields(RunConfig).items():
        model: type[BaseModel] = RunConfig
        *path, name = key.split(".")
        for part in path:
            model = model.model_fields[part].annotation
        out[key] = (model, name, kind)
    return out


def test_every_registry_field_default_is_registered() -> None:
    fields = _registry_fields()
    assert {"rl.engine", "rl.algorithm", "rl.loss.policy_loss", "rl.advantage.estimator", "agent.cache.tools",
            "eval.benchmarks", "serve.backend", "rl.rollout.backend"} <= set(fields)
    for model, name, kind in fields.values():
        default = model.model_fields[name].get_default(call_default_factory=True)
        for value in default if isinstance(default, list) else [default]:
            if value is not None:
                find_registry(kind).get(value)  # raises naming the default that is not registered


def test_no_literal_copies_a_registry() -> None:
    registries = {kind: set(find_registry(kind).names()) for kind in registry_kinds()}

    def literals(model: type[BaseModel], prefix: str = ""):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                yield from literals(annotation, f"{prefix}{name}.")
            for arg in (annotation, *typing.get_args(annotation)):
                if typing.get_origin(arg) is typing.Literal:
                    yield f"{prefix}{name}", set(typing.get_args(arg))

    for key, choices in literals(RunConfig):
        copied = [kind for kind, names in registries.items() if names and choices <= names]
        assert not copied, f"{key} lists {sorted(choices)} as a Literal: declare registry({copied[0]!r}) instead"


def test_loading_a_config_that_keeps_default_names_imports_no_stage_code() -> None:
    code = ("import sys; from stages.core.config.loader import load_config; load_config('tiny-cpu'); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('stages.rl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout  # `arpo config show` stays light
