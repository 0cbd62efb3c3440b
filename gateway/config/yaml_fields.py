"""Reading the gateway's YAML config into typed values: `${ENV}` / `${ENV:-default}` expansion in string
values, and the field checks the records in gateway/config/gateway_config.py are built with (each error names
its field).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields
from enum import Enum
from typing import Any

import yaml

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """The configuration file is missing, unparsable or names an invalid value."""


def expand_env(text: str, environ: Mapping[str, str]) -> str:
    """Replace `${NAME}` (must be set) and `${NAME:-default}` (default when unset or empty)."""
    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = environ.get(name)
        if value:
            return value
        if default is not None:
            return default
        if value is None:
            raise ConfigError(f"environment variable {name} is not set (use ${{{name}:-default}})")
        return value
    return _ENV_RE.sub(substitute, text)


def quote_hint(text: str, exc: yaml.YAMLError) -> str:
    """Inside `[...]` or `{...}` an unquoted `${X}` is YAML syntax, not a string: say how to quote it."""
    mark = getattr(exc, "problem_mark", None)
    lines = text.splitlines()
    if mark is None or mark.line >= len(lines) or "${" not in lines[mark.line]:
        return ""
    return "\n(a `${...}` inside [...] or {...} must be quoted: `{name: \"${X:-a}\"}`)"


def expand_tree(value: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return expand_env(value, environ)
    if isinstance(value, list):
        return [expand_tree(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: expand_tree(v, environ) for k, v in value.items()}
    return value


def as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    return value


def check_known(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}")


def typed_field(raw: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    value = raw.get(name, default)
    if value is None or value is default:
        return value
    if isinstance(value, str) and kind in (int, float, bool):  # e.g. `port: ${PORT}`
        value = _from_string(value, kind, f"{where}.{name}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}.{name}: expected {getattr(kind, '__name__', kind)}")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}.{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _from_string(value: str, kind: type, where: str) -> Any:
    try:
        if kind is bool:
            return {"true": True, "false": False}[value.strip().lower()]
        return kind(value)
    except (KeyError, ValueError):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}") from None


def enum_value(enum: type[Enum], value: Any, where: str) -> Any:
    try:
        return enum(value)
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not one of {[m.value for m in enum]}") from None


def simple_record(cls: type, raw: Any, where: str) -> Any:
    """Build a dataclass of scalar fields, each typed like its default."""
    raw = as_mapping(raw, where)
    defaults = cls()
    names = {f.name for f in fields(cls)}
    check_known(raw, names, where)
    kwargs = {}
    for name in names:
        default = getattr(defaults, name)
        kind = float if isinstance(default, float) else str if default is None else type(default)
        kwargs[name] = typed_field(raw, name, kind, default, where)
    return cls(**kwargs)
