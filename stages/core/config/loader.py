"""YAML profiles + `key.sub=value` overrides -> a validated, frozen RunConfig.

The config models (stages/core/config/<section>.py) hold every default, once. A profile
(configs/profiles/<profile>.yaml) states only what differs from them; `extends: <profile>` starts it from another
profile (deep-merged: a mapping merges key by key, any other value, lists included, replaces). Each override
comes last. Any unknown key fails before work starts, naming the key and the nearest valid one; a value naming a
registry entry (a loss, a tool, a benchmark) is checked against the registry (names.py).
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, StringConstraints, ValidationError

from stages.core.config.names import unknown_names
from stages.core.config.root import RunConfig
from stages.core.config.section import IGNORED_SETTING
from stages.core.errors import BadInputError

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"

# Keys a config could set once and no longer can: {key: the fix}, `{value}` being the value the config gives. A
# profile written for an earlier version then fails with the replacement, not a guess at a similar key.
RETIRED_KEYS = {
    "rl.rollout.strategy": "rl.algorithm is the one source of the algorithm, and it picks how the rollout grows "
                           "(stages/core/algorithm_spec.py): set rl.algorithm instead (rl.algorithm={value}) and "
                           "remove rl.rollout.strategy",
}


class ConfigError(BadInputError):
    """A config problem, phrased with the key and the fix (a ValueError; never retried)."""


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    except (OSError, UnicodeDecodeError) as err:  # unreadable, a folder, not text
        raise ConfigError(f"cannot read config file {path}: {getattr(err, 'strerror', None) or err}; "
                          "point -p at a readable UTF-8 YAML file") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """'rl.rollout.n=8' -> (['rl', 'rollout', 'n'], 8). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value (e.g. rl.rollout.n=8)")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def profile_names(config_dir: Path = CONFIG_DIR) -> list[str]:
    return sorted(p.stem for p in (config_dir / "profiles").glob("*.yaml"))


# Flow parameters are typed with these, so the UI's run form offers the shipped profiles as choices and refuses
# a malformed override before a run starts; a profile outside configs/profiles/ is given as a .yaml path.
ProfileName = Literal[tuple(profile_names())]  # type: ignore[valid-type]
ProfilePath = Annotated[str, StringConstraints(pattern=r"\.ya?ml$")]
Profile = ProfileName | ProfilePath
Override = Annotated[str, StringConstraints(pattern=r"^\s*[A-Za-z_][\w-]*(\.[\w-]+)*\s*="),
                     Field(description="key.sub=value, e.g. rl.rollout.n=8 (value parsed as YAML)")]


def load_config(profile: str = "tiny-cpu", overrides: list[str] | tuple[str, ...] = (),
                config_dir: Path | str | None = None, extra_file: Path | str | None = None) -> RunConfig:
    config_dir = Path(config_dir) if config_dir else CONFIG_DIR
    path = profile_path(profile, config_dir)
    data = read_profile(path, config_dir)
    if extra_file:
        data = deep_merge(data, read_yaml(Path(extra_file)))
    data["profile"] = path.stem
    for text in overrides:
        parts, value = parse_override(text)
        apply_override(data, parts, value)
    return validate(data)


def profile_path(profile: str, config_dir: Path, relative_to: Path | None = None) -> Path:
    """A profile name under <config_dir>/profiles/, or a .yaml path (relative to `relative_to` when given)."""
    if profile.endswith((".yaml", ".yml")):
        path = Path(profile)
        return path if path.is_absolute() or relative_to is None else relative_to / path
    path = config_dir / "profiles" / f"{profile}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(profile, profile_names(config_dir), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"no profile {profile!r} ({path} is missing).{hint} Profiles: {profile_names(config_dir)}")
    return path


def read_profile(path: Path, config_dir: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A profile's settings, with those of the profile it `extends` (recursively) underneath."""
    if not path.is_file():
        raise ConfigError(f"no profile {str(path)!r} ({path} is missing): give a profile name or a .yaml file path")
    data = read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: extends must name one profile (e.g. extends: arpo-qwen3-14b-deepsearch), "
                          f"got {parent!r}")
    parent_file = profile_path(parent, config_dir, relative_to=path.parent)
    if parent_file.resolve() in {p.resolve() for p in (*chain, path)}:
        names = " -> ".join(p.stem for p in (*chain, path, parent_file))
        raise ConfigError(f"{path}: extends {parent!r} makes a cycle ({names}); remove one of the extends")
    return deep_merge(read_profile(parent_file, config_dir, (*chain, path)), data)


def validate(data: dict[str, Any]) -> RunConfig:
    unknown = unknown_names(data, RunConfig)
    if unknown:
        raise ConfigError("invalid config:\n  " + "\n  ".join(unknown))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(explain(err)) from None


def explain(err: ValidationError) -> str:
    lines = []
    for issue in err.errors():
        loc = [str(p) for p in issue["loc"]]
        key = ".".join(loc)
        if issue["type"] == "extra_forbidden" and key in RETIRED_KEYS:
            fix = RETIRED_KEYS[key].format(value=_scalar(issue.get("input")))
            lines.append(f"config key {key!r} was removed: {fix} (from the profile or the -o overrides)")
        elif issue["type"] == "extra_forbidden":
            valid = _fields_at(RunConfig, loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            fix = f"did you mean {'.'.join(loc[:-1] + [close[0]])!r}?" if close else f"valid keys here: {valid}"
            lines.append(f"unknown config key {key!r}: {fix}")
        elif issue["type"] == "value_error":  # a cross-field rule: its message names the keys and the fix
            msg = str(issue["msg"]).removeprefix("Value error, ")
            # a section used in several places names its keys from its own name (`vllm.devices=...`): the full path
            lines.append(".".join(loc[:-1] + [msg]) if loc and msg.startswith(f"{loc[-1]}.") else msg)
        elif issue["type"] == IGNORED_SETTING:  # section.py: one rule for settings the chosen mode ignores
            lines.append(_ignored(f"{key}." if key else "", issue["ctx"]))
        else:
            where = f"{key}: " if key else ""
            lines.append(f"{where}{issue['msg']} (got {issue.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _ignored(prefix: str, ctx: dict[str, Any]) -> str:
    field, mode, allowed = f"{prefix}{ctx['field']}", f"{prefix}{ctx['mode']}", ctx["allowed"]
    value = ctx["value"]
    shown = f"={_scalar(value)}" if not isinstance(value, (BaseModel, dict, list, tuple)) else " (set)"
    return (f"{field}{shown} is ignored under {mode}={_scalar(ctx['chosen'])}: it is used only with "
            f"{mode}={'|'.join(_scalar(v) for v in allowed)}. Set {mode}={_scalar(allowed[0])} to use it, or remove "
            f"{field} (from the profile or the -o overrides)")


def _scalar(value: Any) -> str:
    """A value as it is written in YAML / an override."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    for part in path:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def to_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
