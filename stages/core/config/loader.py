"""YAML profiles + `key.sub=value` overrides -> a validated, frozen RunConfig.

Order: configs/base.yaml, then configs/profiles/<profile>.yaml (deep-merged), then each override.
Any unknown key fails before work starts, naming the key and the nearest valid one.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, StringConstraints, ValidationError

from stages.core.config.root import RunConfig
from stages.core.errors import BadInputError

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"


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
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
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
    profile_path = Path(profile) if profile.endswith((".yaml", ".yml")) else config_dir / "profiles" / f"{profile}.yaml"
    if not profile_path.is_file():
        close = difflib.get_close_matches(profile, profile_names(config_dir), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"no profile {profile!r} ({profile_path} is missing).{hint} "
                          f"Profiles: {profile_names(config_dir)}")
    data = read_yaml(config_dir / "base.yaml")
    data = deep_merge(data, read_yaml(profile_path))
    if extra_file:
        data = deep_merge(data, read_yaml(Path(extra_file)))
    data["profile"] = profile_path.stem
    for text in overrides:
        parts, value = parse_override(text)
        apply_override(data, parts, value)
    return validate(data)


def validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(explain(err)) from None


def explain(err: ValidationError) -> str:
    lines = []
    for issue in err.errors():
        loc = [str(p) for p in issue["loc"]]
        key = ".".join(loc)
        if issue["type"] == "extra_forbidden":
            valid = _fields_at(RunConfig, loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            fix = f"did you mean {'.'.join(loc[:-1] + [close[0]])!r}?" if close else f"valid keys here: {valid}"
            lines.append(f"unknown config key {key!r}: {fix}")
        elif issue["type"] == "value_error":  # a cross-field rule: its message names the keys and the fix
            lines.append(str(issue["msg"]).removeprefix("Value error, "))
        else:
            where = f"{key}: " if key else ""
            lines.append(f"{where}{issue['msg']} (got {issue.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


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
