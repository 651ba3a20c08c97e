"""The one command line of every ``retromae-ds`` command: its options are the fields of the
command's config dataclass, spelt as in the config file, dotted by section.

    retromae-ds pretrain --config job.yaml --optim.lr 2e-4 --checkpoint.resume auto
    retromae-ds eval --model OUT/encoder --beir data/scifact --max_length 256 --normalize

One spelling (``docs/architecture.md`` says why): ``--section.field_name VALUE`` (or
``--section.field_name=VALUE``), the name a ``--config`` file, a run's saved
``config.json``, an error message and ``--help`` all use. Booleans read ``--flag`` (true) or
``--flag true|false``; lists read ``--field a b c``, JSON or ``a,b,c``; ``none`` empties an
optional field. The command line wins over the file, which wins over the defaults.

Old spellings keep working with one note each on stderr (``canonical_argv``):
``--kebab-case`` names, ``--no-flag`` negations, and any old name in the config's
``RENAMED`` (which also applies inside ``--config`` files and saved run configs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from retromae_ds.base.config import (
    FLAG_KEY,
    apply_renamed,
    from_dict,
    help_text,
    leaf_fields,
    load_file,
    merge_dotted,
    note_renamed,
    optional_of,
    renamed_key,
)
from retromae_ds.base.errors import USER_ERRORS, run_reporting

T = TypeVar("T")

SYNTAX = (
    "Every setting below is an option, spelt as in a --config file: --section.field VALUE (or\n"
    "--section.field=VALUE). Booleans: --flag alone means true, or --flag true|false. Lists:\n"
    "--field a b c, JSON or comma-separated. none empties an optional field. The command line\n"
    "wins over the --config file (YAML or JSON, sections nested), which wins over the defaults.\n"
    "Old spellings (--kebab-case, --no-flag, renamed fields) still work, with a note. Settings:"
)

BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "1", "0"})
NULL_WORDS = frozenset({"none", "null"})

LAUNCHER_OPTIONS = ("local_rank",)
"""Options a launcher adds to the command line rather than the user (the ``deepspeed``
launcher's ``--local_rank=N``): taken off, and exported as ``LOCAL_RANK`` (which the
process group reads) unless the environment already sets it."""


@dataclass(frozen=True)
class Leaf:
    """One setting of a command: a leaf field of its config dataclass."""

    dotted: str
    tp: Any
    default: Any
    shape: dict[str, Any]

    @property
    def positional(self) -> bool:
        return bool(self.shape.get("positional"))

    @property
    def is_bool(self) -> bool:
        return optional_of(self.tp) is bool

    @property
    def is_list(self) -> bool:
        return typing.get_origin(optional_of(self.tp)) in (list, tuple)

    @property
    def optional(self) -> bool:
        return optional_of(self.tp) is not self.tp


def leaves(cls: type) -> dict[str, Leaf]:
    """``{dotted name: Leaf}`` of every setting of config dataclass ``cls``."""
    return {
        dotted: Leaf(dotted, tp, default, dict(f.metadata.get(FLAG_KEY, {})))
        for dotted, f, tp, default in leaf_fields(cls)
    }


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are ValueErrors (one line through ``errors.run_reporting``,
    exit 2, like every other bad input)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ValueError(message)


# --------------------------------------------------------------------------- old spellings
def _resolve(cls: type, table: dict[str, Leaf], key: str) -> tuple[str | None, str | None]:
    """(the setting an option name ``key`` means, a value the name itself implies (``false``
    for ``--no-flag``)), noting an old spelling once; (None, None) for an unknown name."""
    name = key.replace("-", "_")
    if name not in table:
        renamed = renamed_key(cls, name)
        if renamed in table:
            note_renamed(f"--{key}", f"--{renamed}")
            name = renamed
        elif name.startswith("no_"):
            target, _ = _resolve(cls, table, name[3:])
            if target is not None and table[target].is_bool:
                note_renamed(f"--{key}", f"--{target} false")
                return target, "false"
            return None, None
        else:
            return None, None
    elif name != key:
        note_renamed(f"--{key}", f"--{name}")
    return (name, None) if not table[name].positional else (None, None)


def canonical_argv(cls: type, argv: list[str]) -> list[str]:
    """``argv`` in the one spelling: every option as ``--dotted.name``, every boolean as
    ``--dotted.name=VALUE``; launcher options taken off (``LAUNCHER_OPTIONS``). Old
    spellings are noted once each on stderr. An option no setting answers to is a ValueError
    naming every such option."""
    table = leaves(cls)
    positionals = any(leaf.positional for leaf in table.values())
    out: list[str] = []
    unknown: list[str] = []
    spelt: dict[str, str] = {}  # setting -> the first name it was given under
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            out += argv[i - 1 :]
            break
        if not token.startswith("--") or token == "--help":
            out.append(token)
            continue
        key, eq, value = token[2:].partition("=")
        if key.replace("-", "_") in LAUNCHER_OPTIONS:
            if not eq and i < len(argv):
                value, i = argv[i], i + 1
            os.environ.setdefault(key.replace("-", "_").upper(), value)
            continue
        if key == "config":
            out.append(token)
            continue
        dotted, implied = _resolve(cls, table, key)
        if dotted is None:
            unknown.append(key.replace("-", "_"))
            out.append(token)
            continue
        _refuse_two_spellings(spelt, dotted, key)
        leaf = table[dotted]
        if not leaf.is_bool:
            out.append(f"--{dotted}" + (f"={value}" if eq else ""))
            continue
        if implied is not None:
            value = implied
        elif not eq:
            # the next word is this flag's value if it reads as one, or if nothing else could
            # take it (no positionals): a typo then fails as a bad value, naming the field
            words = BOOL_WORDS | (NULL_WORDS if leaf.optional else frozenset())
            nxt = argv[i] if i < len(argv) else "--"
            if nxt.lower() in words or not (nxt.startswith("--") or positionals):
                value, i = nxt, i + 1
            else:
                value = "true"
        out.append(f"--{dotted}={value}")
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
    return out


def _refuse_two_spellings(spelt: dict[str, str], dotted: str, key: str) -> None:
    """One setting under two names on one command line (``--resume none
    --checkpoint.resume auto``) is refused, as a ``--config`` file refuses the pair: which
    one the user meant cannot be told from their order."""
    first = spelt.setdefault(dotted, key)
    if first != key:
        raise ValueError(
            f"--{first} and --{key} both set {dotted} (one is an old name of the other): "
            f"give it once, as --{dotted}"
        )


# ------------------------------------------------------------------------------ the parser
def _usage(prog: str, table: dict[str, Leaf]) -> str:
    words = [prog, "[--config FILE]", "[--section.field VALUE ...]"]
    for leaf in table.values():
        if leaf.positional:
            name = leaf.dotted.upper()
            nargs = leaf.shape.get("nargs")
            words.append(f"[{name} ...]" if nargs == "*" else f"{name} ..." if nargs else name)
    return " ".join(words)


def command_parser(cls: type, *, prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of a command whose settings are config dataclass ``cls``: ``--config
    FILE``, one option per setting (positionals where the field says so), and a ``--help``
    that lists every setting with its type, default and docstring, grouped by section
    (``config.help_text``). It parses ``canonical_argv``'s output; values stay strings
    (converted by the field's type when the config is built) unless the field names a
    ``parse`` function."""
    table = leaves(cls)
    parser = _Parser(
        prog=prog,
        usage=_usage(prog, table),
        description=description,
        epilog=f"{SYNTAX}\n\n{help_text(cls)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML or JSON mapping of the settings below"
    )
    for leaf in table.values():
        kw: dict[str, Any] = {"help": argparse.SUPPRESS}
        if leaf.shape.get("choices") and not leaf.is_list:
            kw["choices"] = leaf.shape["choices"]
        if leaf.shape.get("parse"):
            kw["type"] = leaf.shape["parse"]
        if leaf.positional:
            if leaf.shape.get("nargs"):
                kw["nargs"] = leaf.shape["nargs"]
            parser.add_argument(leaf.dotted, metavar=leaf.dotted.upper(), **kw)
        elif leaf.is_list:
            parser.add_argument(
                f"--{leaf.dotted}", dest=leaf.dotted, nargs="+", action="extend", **kw
            )
        else:
            parser.add_argument(f"--{leaf.dotted}", dest=leaf.dotted, **kw)
    return parser


def _given(table: dict[str, Leaf], namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, ready for ``from_dict``: a list option given
    one word keeps it whole (JSON or comma-separated, read by the field's type); a list
    option given twice holds the words of both (``--beir A --beir B``)."""
    out = {}
    for dotted, value in vars(namespace).items():
        leaf = table.get(dotted)
        if leaf is not None and leaf.is_list and not leaf.positional and len(value) == 1:
            value = value[0]
        out[dotted] = value
    return out


def parse_command(
    cls: type[T], argv: list[str], *, prog: str = "retromae-ds", description: str = ""
) -> T:
    """``cls`` from a command line: its defaults, then the ``--config`` file, then the options
    given (in any spelling ``canonical_argv`` reads). Bad input (an unknown option, a bad
    value, a required setting given nowhere, a file that is not a mapping) is a ValueError
    naming it; ``--help`` prints the settings and exits 0."""
    table = leaves(cls)
    namespace = command_parser(cls, prog=prog, description=description).parse_args(
        canonical_argv(cls, argv)
    )
    file = vars(namespace).pop("config", None)
    data = apply_renamed(cls, load_file(file)) if file is not None else {}
    data = merge_dotted(data, _given(table, namespace))
    missing = []
    for dotted, leaf in table.items():
        node: Any = data
        for part in dotted.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is _ABSENT and leaf.default is _REQUIRED:
            missing.append(dotted.upper() if leaf.positional else f"--{dotted}")
    if missing:
        raise ValueError(f"required: {', '.join(missing)} (on the command line or in --config)")
    return from_dict(cls, data)


def build_config(cls: type[T], file: str | Path | None, overrides: list[str]) -> T:
    """``parse_command`` of an optional config file plus command-line options: how code and
    tests build a config the way a command line would."""
    return parse_command(cls, [*(["--config", str(file)] if file else []), *overrides])


_ABSENT = object()
_REQUIRED = dataclasses.MISSING


def run_command(
    cls: type[T],
    run: Callable[[T], int | None],
    argv: list[str] | None,
    *,
    prog: str,
    description: str = "",
    errors: tuple[type[BaseException], ...] = USER_ERRORS,
) -> int:
    """The one entry path of every command (``retromae-ds NAME``, ``python -m
    retromae_ds.pretrain`` under any launcher, the refresher the trainer starts): parse
    ``argv`` (None: ``sys.argv[1:]``) into ``cls``, run it, and report ``errors`` (bad input
    always) in one line, ``PROG: error: ...`` (``errors.run_reporting``). Returns the exit
    status: ``run``'s, or 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_reporting(
        prog,
        lambda: run(parse_command(cls, argv, prog=prog, description=description)),
        errors=errors,
    )
