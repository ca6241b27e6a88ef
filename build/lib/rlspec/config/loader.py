"""Loading a config: find the recipe, read its YAML, apply `key=value` overrides, build and type-check it.

`load_config("grpo_math.yaml", ["grpo.max_steps=3"])` resolves the recipe (a path, or a name looked up
in config_search_dirs()), applies dotted overrides and builds `Config` (rlspec/config/schema.py)
field by field against the dataclasses' type hints. Mistakes raise a `ConfigError` that names the
nearest valid key, the expected type or the valid choices. `format_help` prints every key for `--help`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from rlspec.config.ranges import field_rule
from rlspec.config.schema import Config, ConfigError


# ---------------------------------------------------------------------------------------------
# Loading


CONFIG_DIRS_ENV = "RLSPEC_CONFIG_DIR"  # extra place to look for recipes by name


def load_config(path_or_name: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (a path, or a name found in configs/), apply `key=value` overrides, validate.

    With no path the defaults of the dataclasses are used (plus overrides).
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path_or_name:
        path = resolve_config_path(path_or_name)
        source = str(path)
        raw = _read_yaml(path)
    for text in overrides or []:
        _apply_override(raw, text)
    return build(Config, raw, source)


def config_search_dirs() -> list[Path]:
    """Where a recipe named without a directory is looked for, in order."""
    dirs = [Path.cwd(), Path.cwd() / "configs"]
    if os.environ.get(CONFIG_DIRS_ENV):
        dirs.insert(0, Path(os.environ[CONFIG_DIRS_ENV]))
    # the recipes that ship with the package: rlspec/configs links to the checkout's configs/ and is copied
    # into a wheel, so a name resolves from any directory, in a checkout or installed (this file is
    # rlspec/config/loader.py; parents[1] is the rlspec package)
    dirs.append(Path(__file__).resolve().parents[1] / "configs")
    return list(dict.fromkeys(dirs))


def resolve_config_path(path_or_name: str) -> Path:
    """An existing path as given, else the name (with .yaml added if missing) in config_search_dirs()."""
    given = Path(path_or_name).expanduser()
    names = [given] if given.suffix in (".yaml", ".yml") else [given, given.with_name(given.name + ".yaml")]
    tried: list[Path] = []
    for name in names:
        candidates = [name] if name.is_absolute() else [name] + [d / name for d in config_search_dirs()]
        for cand in candidates:
            tried.append(cand)
            if cand.is_file():
                return cand
    looked = "\n  ".join(str(p) for p in dict.fromkeys(tried))
    raise ConfigError(
        f"config file {path_or_name!r} not found. Looked in:\n  {looked}\n"
        f"Pass an existing path, a name from configs/ (e.g. config=grpo_math.yaml), or set {CONFIG_DIRS_ENV}."
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _apply_override(raw: dict[str, Any], text: str) -> None:
    """Set one dotted `key=value` into the raw dict, checking the key against the schema first."""
    key, sep, value_text = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not key=value (e.g. grpo.max_steps=3 or drafter.drafter=suffix)")
    parts = key.split(".")
    where = f"override {text!r}"
    tp = _schema_type(parts, where)
    value = _parse_override_value(value_text, tp)
    if tp is not Any:
        value = _coerce(value, tp, key, where)  # type errors name the override, not the file
        _check_override_range(parts, value, where)  # and so do range errors
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    node[parts[-1]] = value


def _check_override_range(parts: list[str], value: Any, where: str) -> None:
    """The overridden field's rule (rlspec/config/ranges.py), so the error names the override."""
    cls: Any = Config
    for p in parts[:-1]:
        cls = _hints(cls)[p]
        if not _is_dataclass_type(cls):
            return  # a key below a free-form dict field: checked with its section
    rule = field_rule(cls, parts[-1])
    problem = rule.problem(value) if rule is not None else None
    if problem:
        raise ConfigError(f"{where}: {'.'.join(parts)} {problem}")


def _schema_type(parts: list[str], where: str) -> Any:
    """The declared type at a dotted key; keys below a free-form dict field are accepted as Any."""
    cls: Any = Config
    for i, p in enumerate(parts):
        hints = _hints(cls)
        if p not in hints:
            section = ".".join(parts[:i]) or None
            raise ConfigError(_unknown_key_message(p, list(hints), section, where))
        tp = hints[p]
        if _is_dataclass_type(tp):
            cls = tp
            continue
        if _base(tp) is dict:
            return tp if i == len(parts) - 1 else Any  # free-form below a dict field (grpo.extra.<any>)
        if i != len(parts) - 1:
            name = ".".join(parts[: i + 1])
            raise ConfigError(f"{where}: {name} has type {_type_name(tp)}, not a section; it has no sub-keys")
        return tp
    example = f"{'.'.join(parts)}.{next(iter(_hints(cls)))}=..."
    raise ConfigError(f"{where}: {'.'.join(parts)} is a section; set one of its keys (e.g. {example})")


def build_from_words(cls: Any, words: list[str], source: str) -> Any:
    """Dataclass `cls` from command-line `key=value` words, each value typed by cls's hints as an
    override is (so `judge_threshold=1e-9` is the float 1e-09, not YAML 1.1's string)."""
    hints = _hints(cls)
    raw: dict[str, Any] = {}
    for word in words:
        if "=" not in word:
            raise ConfigError(f"{source}: expected key=value words (e.g. verification=judge), got {word!r}")
        key, text = word.split("=", 1)
        raw[key] = _parse_override_value(text, hints[key]) if key in hints else text  # unknown: build() says so
    return build(cls, raw, source)


def _parse_override_value(text: str, tp: Any) -> Any:
    """Parse as a YAML scalar, except that string fields take the text verbatim (run_name=123 stays '123')."""
    text = text.strip()
    wants_str = _base(tp) is str or (get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp)))
    if wants_str and text not in ("null", "None", "~"):
        return text
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return text


# ---------------------------------------------------------------------------------------------
# Validation


def build(cls: Any, raw: Any, source: str, prefix: str = "") -> Any:
    """Construct dataclass `cls` from a raw mapping, checking keys and types (recursing into sections)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix or 'config'} must be a mapping of keys, got {type(raw).__name__} {raw!r}")
    hints = _hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(_unknown_key_message(str(key), list(hints), prefix or None, source))
        name = f"{prefix}.{key}" if prefix else str(key)
        kwargs[key] = _coerce(value, hints[key], name, source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except ValueError as e:  # a section's own validation (e.g. SpecConfig: an unknown drafter)
        raise ConfigError(f"{source}: {prefix + '.' if prefix else ''}{e}") from None


def _coerce(value: Any, tp: Any, name: str, source: str) -> Any:
    if _is_dataclass_type(tp):
        return build(tp, {} if value is None else value, source, name)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {name} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (Union, _UnionType) and type(None) in args:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name, source)
    if origin is list:
        if isinstance(value, str):
            value = [value]  # rewards=accuracy on the command line means a one-item list
        if not isinstance(value, list):
            raise _type_error(name, tp, value, source)
        return [_coerce(v, args[0], f"{name}[{i}]", source) for i, v in enumerate(value)] if args else value
    return _coerce_scalar(value, _base(tp), name, source, tp)


def _coerce_scalar(value: Any, base: Any, name: str, source: str, tp: Any) -> Any:
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        if isinstance(value, str):
            # YAML 1.1 reads `1e-6` (no dot) as a string; accept it as the float the user meant.
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        ok = isinstance(value, str)
    elif base is dict:
        ok = isinstance(value, dict)
        value = dict(value) if ok else value
    else:
        ok = True
    if not ok:
        raise _type_error(name, tp, value, source)
    return value


def _type_error(name: str, tp: Any, value: Any, source: str) -> ConfigError:
    return ConfigError(f"{source}: {name} expects {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _unknown_key_message(key: str, valid: list[str], section: str | None, where: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    full = f"{section}.{key}" if section else key
    place = f"in section '{section}'" if section else "at the top level"
    hint = f" Did you mean '{section + '.' if section else ''}{close[0]}'?" if close else ""
    return f"{where}: unknown key '{full}' {place}.{hint} Valid keys {place}: {', '.join(valid)}."


# ---------------------------------------------------------------------------------------------
# Type helpers and --help


_UnionType = type(int | None)


def _hints(cls: Any) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _base(tp: Any) -> Any:
    """Strip Optional[...] and generics: `int | None` -> int, `dict[str, Any]` -> dict."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, _UnionType):
        inner = [a for a in args if a is not type(None)]
        return _base(inner[0]) if len(inner) == 1 else tp
    return origin or tp


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, _UnionType):
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def format_help(cls: Any = Config, prefix: str = "") -> str:
    """Every key with its type, default and help string, one per line (for `--help`)."""
    lines = []
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        name = f"{prefix}{f.name}"
        if _is_dataclass_type(tp):
            lines.append(f"\n[{name}] {f.metadata.get('help', '')}")
            lines.append(format_help(tp, name + "."))
            continue
        default = getattr(defaults, f.name)
        rule = field_rule(cls, f.name)
        allowed = f"; must be {rule.text()}" if rule is not None else ""
        lines.append(f"  {name} ({_type_name(tp)}, default {default!r}{allowed}): {f.metadata.get('help', '')}")
    return "\n".join(lines)
