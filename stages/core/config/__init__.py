"""Config models (one module per section) and the YAML loader."""

from stages.core.config.loader import (
    CONFIG_DIR,
    ConfigError,
    Override,
    Profile,
    load_config,
    profile_names,
    to_yaml,
)
from stages.core.config.root import RunConfig

__all__ = ["CONFIG_DIR", "ConfigError", "Override", "Profile", "RunConfig", "load_config", "profile_names", "to_yaml"]
