"""Nested dataclass configs: read from YAML/JSON mappings, every value converted by its
field's type annotation, so a typo or a bad value fails with the field's name instead of deep
inside training; old field names (``RENAMED``) moved to their new place with a note; the
``--help`` text of a config (every field with its dotted name, type, default and docstring,
the string literal under the field read from the source with ``ast``).

The command line over these configs is ``base.options`` (``parse_command``, ``build_config``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import re
import sys
import textwrap
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
        return _build(tp, value, where)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = _list_text(value, where)
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {value!r}")
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
        return _to_int(value, where)
    if tp is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{where}: unsupported config type {tp}")


INT_LIMIT = 2**63
"""Integers are held to a signed 64-bit range: every count, step and seed here ends in a C
integer (torch, numpy, Arrow), where a larger one fails far from the option that set it."""


def _to_int(value: Any, where: str) -> int:
    """``value`` as an integer: an int, a float or numeric string that is a whole number
    (``1e3``, ``2.0``), within the 64-bit range; anything else is one line naming ``where``."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"{where}: expected an integer, got {value!r}") from None
    if isinstance(number, float):
        if not math.isfinite(number) or not number.is_integer():
            raise ValueError(f"{where}: expected a whole number, got {value!r}")
        number = int(number)
    if not isinstance(number, int):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if not -INT_LIMIT <= number < INT_LIMIT:
        raise ValueError(f"{where}: {value!r} is out of range (at most 2**63 - 1 in size)")
    return number


def _list_text(text: str, where: str) -> list[Any]:
    """A list option's text: a JSON list (``["a", "b"]``) or comma-separated words."""
    if not text.strip().startswith("["):
        return text.split(",")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: {text!r} starts like a JSON list but is not one ({exc.msg} at column "
            f"{exc.colno}); quote its strings (e.g. '[\"a.json\"]') or give the items "
            "separated by spaces or commas"
        ) from None
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, got {text!r}")
    return value


_NOTED: set[str] = set()
"""Old field names already noted in this process (one note each)."""


def _parent_of(data: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """(the mapping holding dotted field ``dotted`` in ``data``, or None; its last name)."""
    *parents, leaf = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) and leaf in node else None), leaf


def note_renamed(old: str, new: str) -> None:
    """Say once per old name and process, on stderr, that option or field ``old`` is now
    ``new`` (``--kebab-case`` and ``--dotted.name`` forms of one name count as one), whether a
    config file or the command line (``base.options``) used it."""
    key = old.lstrip("-").replace("-", "_")
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"note: {old} is now {new} (the old name still works)", file=sys.stderr)


def apply_renamed(
    cls: type, data: dict[str, Any], *, quiet: bool = False, saved: bool = False
) -> dict[str, Any]:
    """``data`` (a nested mapping for ``cls``) with the old names in ``cls.RENAMED`` (``{old
    dotted name: new dotted name}``, relative to ``cls``) and in its sections' ``RENAMED``
    moved to their new place; each old name used is noted once per process on stderr (unless
    ``quiet``). Both names at once is an error naming them, unless they hold the same value,
    or ``saved``: a config a run saved lists every field, so an old run's file holds both,
    and the old name is the one it ran with."""
    data = json.loads(json.dumps(data))
    _rename(cls, data, quiet, saved, "")
    return data


def _rename(cls: type, data: dict[str, Any], quiet: bool, saved: bool, prefix: str) -> None:
    """``apply_renamed`` in place, ``cls``'s sections included (``prefix``: where ``cls``
    sits, for the note)."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        holder, leaf = _parent_of(data, old)
        if holder is None or (new.startswith(old + ".") and isinstance(holder[leaf], dict)):
            continue  # an old field that is now the section holding its new name: a section
        there, new_leaf = _parent_of(data, new)
        if there is not None and not saved and there[new_leaf] != holder[leaf]:
            raise ValueError(f"{old} and {new} are one field (renamed): give only {new}")
        value = holder.pop(leaf)  # first: the old field may bear the new section's name
        node = data
        *parents, new_leaf = new.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[new_leaf] = value
        if not quiet:
            note_renamed(prefix + old, prefix + new)
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _is_section(hints[f.name]) and isinstance(data.get(f.name), dict):
                _rename(hints[f.name], data[f.name], quiet, saved, f"{prefix}{f.name}.")


def renamed_key(cls: type, dotted: str) -> str:
    """The current name of the dotted field (or section member) ``dotted`` of ``cls``
    (old names in the ``RENAMED`` of ``cls`` or of the sections it names); the caller notes
    the rename."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if dotted == old or dotted.startswith(old + "."):
            return new + dotted[len(old) :]
    head, _, rest = dotted.partition(".")
    if rest and dataclasses.is_dataclass(cls):
        section = typing.get_type_hints(cls).get(head)
        if _is_section(section):
            inner = renamed_key(section, rest)
            if inner != rest:
                return f"{head}.{inner}"
    return dotted


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) mapping; unknown keys are an error (old names
    in ``cls.RENAMED`` and its sections' are accepted: ``apply_renamed``)."""
    return _build(cls, apply_renamed(cls, data), where)


def _build(cls: type[T], data: dict[str, Any], where: str) -> T:
    """``from_dict`` of a mapping whose old names are already moved (sections included)."""
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
    """The mapping in a YAML (``.yaml``/``.yml``, any case) or JSON config file; a file that
    is not one is a ValueError naming the file, line and column. YAML values that look like
    dates stay the text they are (``run_dir: 2024-01-01`` is a folder name)."""
    if not str(path).strip():
        raise ValueError("--config: an empty path; name a YAML or JSON file")
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{raw[exc.start]:02x})"
        ) from None
    if path.suffix.lower() in (".yaml", ".yml"):
        data = _load_yaml(path, text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping")
    return data


def _load_yaml(path: Path, text: str) -> Any:
    """YAML ``text`` (of ``path``) read safely, timestamps left as strings."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    try:
        return yaml.load(text, Loader=Loader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path}{where}: not valid YAML ({reason})") from None


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


def _class_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(class docstring, {field: docstring}) of ``cls``'s own body; empty without source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return "", {}
    node = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__),
        None,
    )
    if node is None:
        return "", {}
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return ast.get_docstring(node) or "", docs


def field_docs(cls: type) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls`` ("" where it has none).

    Read with ``ast`` from the source of ``cls`` and of its dataclass bases; a field redeclared
    without a docstring keeps its base's. Classes without source (built at run time, frozen
    applications) give empty strings rather than an error.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update({k: v for k, v in _class_docs(klass)[1].items() if v})
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    """A short readable form of a type annotation: ``int``, ``list[str]``, ``int | None``."""
    if isinstance(tp, str):
        return tp
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _show_value(value: Any) -> str:
    """A default as it would be typed on the command line (strings quoted, JSON lists)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | list | tuple | dict):
        try:
            return json.dumps(value, ensure_ascii=False)
        except TypeError:
            pass
    return repr(value)


_MISSING = dataclasses.MISSING


def _default_of(f: dataclasses.Field, instance: Any) -> Any:
    """A field's default: from the enclosing section's default instance when there is one (a
    section built by ``default_factory=lambda: OptimConfig(lr=2e-5)`` has its own defaults),
    else from ``default`` / ``default_factory``; ``_MISSING`` for a required field."""
    if instance is not None:
        return getattr(instance, f.name, _MISSING)
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        try:
            return f.default_factory()
        except Exception:  # a factory that cannot run without context: show no default
            return _MISSING
    return _MISSING


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


RESUME_KEY = "resume"


def resumable(default: Any = _MISSING, *, default_factory: Any = _MISSING) -> Any:
    """A config field (or section) a resumed run may change: how long, how often, where to
    log and save, how to wait. ``training.loop.check_resume_config`` lets it differ from the
    run's saved config; every other field changes what the resumed steps compute."""
    metadata = {RESUME_KEY: "may_change"}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def resume_may_change(cls: type, prefix: str = "") -> set[str]:
    """Dotted names of the fields and sections of ``cls`` marked :func:`resumable`."""
    hints = typing.get_type_hints(cls)
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.metadata.get(RESUME_KEY) == "may_change":
            out.add(prefix + f.name)
        elif _is_section(hints[f.name]):
            out |= resume_may_change(hints[f.name], f"{prefix}{f.name}.")
    return out


def flat_defaults(cls: type, instance: Any = None, prefix: str = "") -> dict[str, Any]:
    """``{dotted field: default}`` of ``cls`` (a section's defaults from its default instance;
    required fields left out)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = _default_of(f, instance)
        if _is_section(hints[f.name]):
            inner = None if value is _MISSING else value
            out.update(flat_defaults(hints[f.name], inner, f"{prefix}{f.name}."))
        elif value is not _MISSING:
            out[prefix + f.name] = json.loads(json.dumps(value, default=str))
    return out


def _wrap(text: str, indent: str, width: int) -> list[str]:
    """Fill each paragraph of ``text`` to ``width`` columns, keeping blank lines between."""
    lines: list[str] = []
    for paragraph in text.split("\n\n"):
        if lines:
            lines.append("")
        lines += textwrap.wrap(
            " ".join(paragraph.split()),
            width=width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )
    return lines


def help_text(cls: type, *, width: int = 100) -> str:
    """Every field of dataclass ``cls`` as ``--dotted.name TYPE (default: ...)`` with its
    docstring, grouped by section (nested dataclass fields), fitting ``width`` columns."""
    lines: list[str] = []
    _help_section(cls, "", None, "", lines, width)
    return "\n".join(lines).strip("\n") + "\n"


def _help_section(
    cls: type, prefix: str, instance: Any, doc: str, lines: list[str], width: int
) -> None:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: show them as written
        hints = {}
    docs = field_docs(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    if prefix:
        lines += ["", f"{prefix}  ({cls.__name__})"]
        class_doc = _class_docs(cls)[0]
        for text in (doc, class_doc):
            if text:
                lines += _wrap(text, "  ", width)
    sections = []
    for f in fields:
        tp = hints.get(f.name, f.type)
        if _is_section(tp):
            sections.append((f, tp))
            continue
        default = _default_of(f, instance)
        shape = f.metadata.get(FLAG_KEY, {})
        dotted = f"{prefix}{'.' if prefix else ''}{f.name}"
        if shape.get("positional"):
            head = f"  {dotted.upper()} {_type_name(tp)}"
            tail = "(positional, required)" if default is _MISSING else "(positional)"
        else:
            head = f"  --{dotted} {_type_name(tp)}"
            tail = "(required)" if default is _MISSING else f"(default: {_show_value(default)})"
        if shape.get("choices"):
            tail = f"{tail[:-1]}; one of: {', '.join(shape['choices'])})"
        if len(head) + 2 + len(tail) <= width:
            lines.append(f"{head}  {tail}")
        else:
            lines += [head, *_wrap(tail, "        ", width)]
        if docs.get(f.name):
            lines += _wrap(docs[f.name], "        ", width)
    for f, tp in sections:
        default = _default_of(f, instance)
        section_instance = default if isinstance(default, tp) else None
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        _help_section(tp, dotted, section_instance, docs.get(f.name, ""), lines, width)


# ------------------------------------------------------------- how a field reads on the line
FLAG_KEY = "flag"


def flag(
    default: Any = _MISSING,
    *,
    default_factory: Any = _MISSING,
    positional: bool = False,
    nargs: str | None = None,
    choices: tuple[str, ...] | None = None,
    parse: Any = None,
) -> Any:
    """A config field with how it reads on the command line (``base.options``): a
    ``positional`` argument (with ``nargs``) instead of ``--dotted.name VALUE``, ``choices``
    (checked as the line is parsed, listed in ``--help``), ``parse`` (a str -> value function
    such as ``parse_size``). A field declared with plain ``field``/a default reads as
    ``--dotted.name VALUE``."""
    shape = {"positional": positional, "nargs": nargs, "choices": choices, "parse": parse}
    metadata = {FLAG_KEY: {k: v for k, v in shape.items() if v not in (None, False)}}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted name, field, resolved type, default or ``dataclasses.MISSING``) of every leaf
    field of config dataclass ``cls`` (its settings: nested sections flattened into dotted
    names, fields with ``init=False`` left out), in declaration order; ``prefix`` is put before
    every name. ``base.options`` builds a command's options from it."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, default = hints[f.name], _default_of(f, None)
        if _is_section(tp):
            out += leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, tp, default))
    return out


def optional_of(tp: Any) -> Any:
    """The type an optional annotation wraps: ``X`` for ``X | None`` (or ``Optional[X]``),
    else ``tp`` itself (a union of several types is returned whole)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MB', '512KiB', '1G' or a plain byte count -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64MB, 512KB, 1000000)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    return int(float(m.group(1)) * scale)
