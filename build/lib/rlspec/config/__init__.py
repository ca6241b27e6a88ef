"""Run configuration: one dataclass per YAML section, strict loading, `key=value` overrides.

`load_config("grpo_math.yaml", ["grpo.max_steps=3"])` reads a YAML recipe, applies dotted
overrides and checks every key, type and value range against the dataclasses. Mistakes fail early,
before torch is imported, with a `ConfigError` that names the key and the nearest valid key, the
expected type, the valid choices or the allowed range. Keep this package free of heavy imports: the
CLI parses its config first.

Read it in four pieces, each importing only the ones before it:

    ranges.py    what values a field allows (a `Rule` per field: >= 1, in (0, 1], a registered name, ...),
                 checked when a section is built and when a key is overridden
    sections.py  the sections (DataConfig, GRPOSection, PPOSection, RolloutSection, DrafterSection,
                 WandbSection): every key, its type, default and help string
    schema.py    Config (the whole run: top-level keys + the sections), ConfigError, and the checks
                 that span fields (batch sizes vs. group size and data, max_model_len, `extra` keys that
                 shadow a first-class key, Ray settings)
    loader.py    load_config: find the recipe, read YAML, apply overrides, build and type-check
                 Config; unknown-key messages; format_help for `--help`

Everything other modules use is re-exported here: `from rlspec.config import Config, load_config`.
"""
from rlspec.config.sections import (
    DataConfig,
    DrafterSection,
    GRPOSection,
    PPOSection,
    RolloutSection,
    WandbSection,
)
from rlspec.config.schema import Config, ConfigError
from rlspec.config.loader import (
    CONFIG_DIRS_ENV,
    build,
    build_from_words,
    config_search_dirs,
    format_help,
    load_config,
    resolve_config_path,
)

__all__ = [
    "CONFIG_DIRS_ENV",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrafterSection",
    "GRPOSection",
    "PPOSection",
    "RolloutSection",
    "WandbSection",
    "build",
    "build_from_words",
    "config_search_dirs",
    "format_help",
    "load_config",
    "resolve_config_path",
]
