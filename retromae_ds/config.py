"""Nested dataclass configs: load from YAML/JSON, override any field from the command line.

``apply_overrides(cfg, ["--optim.lr", "1e-4", "--model.encoder.name=small"])`` walks the
dotted path and converts the value with the field's type annotation, so a typo or a bad value
fails with the field's name instead of deep inside training.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        is_null = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_null and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError(f"{where}: cannot read {value!r} as {tp}: {'; '.join(errors)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = json.loads(value) if value.strip().startswith("[") else value.split(",")
        items = [_convert(v, item, where) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "true",
            "1",
            "yes",
            "on",
            "false",
            "0",
            "no",
            "off",
        ):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        try:
            return (
                int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
            )
        except ValueError:
            raise ValueError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{where}: unsupported config type {tp}")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) mapping; unknown keys are an error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(f"unknown config field(s): {', '.join(prefix + u for u in unknown)}")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def load_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping")
    return data


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--a.b", "1", "--c=2"]`` -> ``{"a.b": "1", "c": "2"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected --field.path VALUE, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ValueError(f"--{key} needs a value")
            i += 1
            value = args[i]
        out[key.replace("-", "_")] = value
        i += 1
    return out


def merge_dotted(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply dotted-key overrides onto a nested mapping (copying what it changes)."""
    data = json.loads(json.dumps(data))
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--{dotted}: {part} is not a section")
        node[leaf] = value
    return data


def build_config(cls: type[T], file: str | Path | None, overrides: list[str]) -> T:
    """Config from an optional file plus command-line overrides (the latter win)."""
    data = load_file(file) if file else {}
    return from_dict(cls, merge_dotted(data, parse_overrides(overrides)))
