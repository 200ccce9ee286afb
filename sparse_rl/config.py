"""One dataclass per stage is the single source of truth for its options.

A YAML recipe fills the dataclass, flags given on the command line override it, and any key the
dataclass does not know is a usage error naming the file and the key. Nested dataclasses map to
nested YAML mappings.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from sparse_rl.errors import UsageError

T = TypeVar("T")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert a YAML value to the annotated type; raise UsageError naming `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for a in args:
            try:
                return _coerce(value, a, where)
            except UsageError as e:  # try the next member of the union
                errors.append(str(e))
        raise UsageError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UsageError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{where}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        out = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise UsageError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise UsageError(f"{where}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UsageError(f"{where}: expected true/false, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise UsageError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{where}: expected a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise UsageError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise UsageError(f"{where}: expected an integer, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise UsageError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _renamed(cls, data: dict, where: str) -> dict:
    """Old spellings of renamed keys (`cls.RENAMED = {old: new}`) keep working, with one deprecation line
    on stderr; giving both spellings is an error."""
    import sys

    renamed = getattr(cls, "RENAMED", {})
    if not any(k in data for k in renamed):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old in data:
            if new in data:
                raise UsageError(f"{where}: both '{old}' and '{new}' given ('{old}' is the old name of '{new}')")
            print(f"warning: {where}: '{old}' is deprecated; use '{new}'", file=sys.stderr)
            data[new] = data.pop(old)
    return data


def from_dict(cls: type[T], data: dict, where: str = "config") -> T:
    """Build dataclass `cls` from a mapping; unknown keys are a UsageError naming `where.key`."""
    data = _renamed(cls, data, where)
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        known = ", ".join(sorted(types_))
        raise UsageError(f"{where}: unknown key '{unknown[0]}' (known keys: {known})")
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}") for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: {e}") from None
    return obj


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def parse_sets(items: list[str] | None, flag: str = "--set") -> dict:
    """`["loss.eps_high=0.28", "seed=1"]` -> `{"loss.eps_high": 0.28, "seed": 1}`: the values are
    YAML, so numbers, booleans, lists (`[1, 2]`) and null read as they would in a recipe."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag} {item}: expected KEY=VALUE, e.g. {flag} seed=1")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UsageError(f"{flag} {item}: the value is not valid YAML") from None
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: dict | None = None,
                sets: list[str] | None = None) -> T:
    """Resolve a stage config: dataclass defaults < YAML file < `--set KEY=VALUE` < flags.

    `overrides` maps field names (dots for nested fields) to values; None values are ignored so that
    unset Typer options leave the recipe alone. `sets` are the raw `--set` items (see `parse_sets`);
    a flag given explicitly wins over a `--set` of the same key.
    """
    data: dict = {}
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise UsageError(f"--config: file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark is not None else ""
            raise UsageError(f"{p}{line}: invalid YAML ({getattr(e, 'problem', e)})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UsageError(f"{p}: the top level must be a mapping of option names to values")
        data = loaded
    merged = parse_sets(sets)
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for key, value in merged.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"--set {key}: '{part}' is not a section of the config")
        node[parts[-1]] = value
    return from_dict(cls, data, where)


def save_config(obj, path: str | Path) -> None:
    from sparse_rl.io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))
