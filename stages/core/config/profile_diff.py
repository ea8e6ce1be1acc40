"""What a profile changes, and the keys it restates.

`changes`: every resolved key whose value differs from the models' defaults, with where it comes from (the profile
file, a profile it `extends`, an -o override, or implied by another key: the algorithm's defaults, a name that
follows a path). `arpo config show --diff -p NAME` prints them (`diff_text`).

`restated_keys`: the keys a profile file writes that change nothing, because the value equals what the key would be
without it (the model default, what the algorithm implies, or the value inherited through `extends`). A profile
states only what differs (tests/unit/test_config_sources.py holds every shipped profile to it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.config.loader import (
    CONFIG_DIR,
    ConfigError,
    deep_merge,
    load_config,
    parse_override,
    profile_path,
    read_profile,
    read_yaml,
    validate,
)

IMPLIED = "implied"  # the source of a change no file or override writes: another key's value implies it


@dataclass(frozen=True)
class Change:
    key: str        # dotted, e.g. rl.rollout.n
    value: Any      # as resolved, JSON-like
    default: Any    # the models' default
    source: str     # "profile" (its own file), "extends <name>", "-o" or IMPLIED


def leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested mapping; an empty mapping and a list are values."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _at(data: Any, key: str) -> Any:
    """The value at a dotted key, or the first non-mapping on the way (a section that is null)."""
    for part in key.split("."):
        if not isinstance(data, dict):
            return data
        data = data.get(part)
    return data


def _chain(profile: str, config_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, the settings its file writes) for the profile and each profile it extends, the profile first. Call
    after load_config, which has refused a broken or cyclic chain."""
    path, out = profile_path(profile, config_dir), []
    while True:
        own = read_yaml(path)
        out.append((path.stem, own))
        parent = own.get("extends")
        if not parent:
            return out
        path = profile_path(parent, config_dir, relative_to=path.parent)


def changes(profile: str, overrides: list[str] | tuple[str, ...] = (),
            config_dir: Path | str | None = None) -> list[Change]:
    """Each resolved key of the profile (with overrides) that differs from the models' defaults, in config order."""
    config_dir = Path(config_dir) if config_dir else CONFIG_DIR
    resolved = leaves(load_config(profile, overrides, config_dir).model_dump(mode="json"))
    defaults = validate({}).model_dump(mode="json")
    chain = _chain(profile, config_dir)
    written = [("profile", set(leaves(chain[0][1])))]
    written += [(f"extends {name}", set(leaves(own))) for name, own in chain[1:]]
    overridden = {".".join(parse_override(text)[0]) for text in overrides}
    out = []
    for key, value in resolved.items():
        default = _at(defaults, key)
        if key == "profile" or value == default:
            continue
        sources = [source for source, keys in written if _written(key, keys)]
        source = "-o" if _written(key, overridden) else sources[0] if sources else IMPLIED
        out.append(Change(key, value, default, source))
    return out


def _written(key: str, keys: set[str]) -> bool:
    """A resolved key is written by a file or override that sets it or a mapping above it (`interpreters: {...}`)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in keys for i in range(1, len(parts) + 1))


def diff_text(profile: str, overrides: list[str] | tuple[str, ...] = (),
              config_dir: Path | str | None = None) -> str:
    """`arpo config show --diff`: one line per changed key (value, the default, where it comes from), then the keys
    the profile file restates, if any."""
    found = changes(profile, overrides, config_dir)
    width = max((len(c.key) for c in found), default=0)
    lines = [f"# {profile}: {len(found)} keys differ from the defaults (stages/core/config/); "
             f"{IMPLIED} = follows from another key"]
    lines += [f"{c.key:<{width}}  {_show(c.value)}   (default {_show(c.default)}; {c.source})" for c in found]
    restated = restated_keys(profile, config_dir)
    if restated:
        lines.append(f"# restated (remove them: the value is what the key would be without them): "
                     f"{', '.join(restated)}")
    return "\n".join(lines)


def _show(value: Any) -> str:
    """A value as YAML writes it inline."""
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def restated_keys(profile: str, config_dir: Path | str | None = None) -> list[str]:
    """The keys the profile's own file writes whose removal leaves the resolved config unchanged."""
    config_dir = Path(config_dir) if config_dir else CONFIG_DIR
    path = profile_path(profile, config_dir)
    own = read_yaml(path)
    parent = own.get("extends")
    inherited = read_profile(profile_path(parent, config_dir, relative_to=path.parent), config_dir) if parent else {}

    def resolved(data: dict[str, Any]) -> dict[str, Any] | None:
        body = {k: v for k, v in data.items() if k != "extends"}
        try:
            return validate({**deep_merge(inherited, body), "profile": path.stem}).model_dump(mode="json")
        except ConfigError:  # the profile needs the key to be valid at all
            return None

    whole = resolved(own)
    return [key for key in leaves(own) if key != "extends" and resolved(_without(own, key)) == whole]


def _without(data: dict[str, Any], key: str) -> dict[str, Any]:
    """A copy of the mapping without the dotted key (and without the mappings that leaves empty)."""
    out = copy.deepcopy(data)
    parts = key.split(".")
    nodes = [out]
    for part in parts[:-1]:
        nodes.append(nodes[-1][part])
    del nodes[-1][parts[-1]]
    for node, part in zip(reversed(nodes[:-1]), reversed(parts[:-1]), strict=True):
        if node[part] == {}:
            del node[part]
    return out

