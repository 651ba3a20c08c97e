"""An encoder folder's sentence-embedding settings: pooling, normalisation, length.

A sentence-transformers model says how it turns hidden states into an embedding in its own
files: ``modules.json`` (Transformer, then Pooling, then optionally Normalize),
``1_Pooling/config.json`` (``pooling_mode_cls_token`` / ``pooling_mode_mean_tokens`` / ...)
and ``sentence_bert_config.json`` (``max_seq_length``). all-MiniLM-L6-v2, for one, is
mean-pooled, normalised and read up to 256 tokens: fine-tuning or evaluating it with CLS
pooling throws away what it learnt. ``read_spec(folder)`` reads those files (or the
``dual_encoder.json`` a fine-tuning run writes beside them, which wins), so fine-tuning,
evaluation and export default to the encoder's own settings; an explicit setting overrides.
A folder without any of these files (a pre-training checkpoint of another tool) gets CLS
pooling without normalisation, RetroMAE's sentence embedding.

DupMAE's poolings (``dupmae_bow``: the ordinary tokens' max-pooled MLM-head logits, only their
``bow_topk`` largest entries kept; ``dupmae``: [CLS] and that vector concatenated;
``retromae_ds.modeling.bow``) need the MLM head, which sentence-transformers' own modules
cannot express. A folder made for them holds ``dupmae_pooling.json`` (pooling, normalisation,
top-k), which this module and ``HFEncoder.from_dir`` read before ``modules.json``; its
``modules.json`` names CLS pooling, so a plain ``SentenceTransformer(folder)`` gives the [CLS]
vector only, the first H entries of ``dupmae`` and not ``dupmae_bow`` at all.

The poolings themselves (names, which need the MLM head, their sizes, their arithmetic and
the sentence-transformers flag each is written as) are ``retromae_ds.hf.pooling``'s registry;
this module only reads and writes the files. A module these encoders cannot reproduce (a
Dense projection, or a pooling mode no registered pooling computes: max or last-token) is a
``ValueError`` naming the file and the field: silently dropping it would give embeddings that
differ from the model's.

``write_files`` writes the same files for an encoder this tool saves, so sentence-transformers
loads it with its pooling, normalisation and length.

Separate towers (fine-tuning with ``--model.shared false``): an export holds the passage tower
at its root and the query tower in a sub-folder, and its ``modules.json`` starts with a
sentence-transformers ``Router`` (sentence-transformers 5 and later) whose
``router_config.json`` routes ``query`` to the sub-folder's Transformer and ``document`` to
the root's: ``SentenceTransformer(folder).encode_query`` / ``encode_document`` use the right
tower, ``AutoModel.from_pretrained(folder)`` loads the passage tower, and each folder is a
complete model of its own. ``routed_towers(folder)`` reads that routing (any Router whose
``query`` and ``document`` routes are one Transformer each), which ``retromae-ds eval`` uses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retromae_ds.hf import pooling as poolings
from retromae_ds.hf.pooling import AUTO, CLS, DEFAULT_POOLING, for_st_mode, get_pooling

DUAL_ENCODER_FILE = "dual_encoder.json"
DUPMAE_FILE = "dupmae_pooling.json"
"""The settings of a pooling sentence-transformers cannot express (DupMAE's, or any without
an ``st_mode``), read before ``modules.json``."""
DEFAULT_BOW_TOPK = 256
"""Entries of the DupMAE vector kept (the paper's top-k sparsification; 0 keeps all |V|)."""


def embedding_dim(pooling: str, hidden_size: int, vocab_size: int) -> int:
    """Entries of one embedding pooled with ``pooling`` from an encoder of ``hidden_size``
    whose MLM head predicts ``vocab_size`` tokens (DupMAE's ordinary-token vector: V)."""
    return get_pooling(pooling).dim(hidden_size, vocab_size)


def __getattr__(name: str) -> tuple[str, ...]:
    """``POOLINGS`` / ``HEAD_POOLINGS``: the registered poolings' names (those that need the
    MLM head), read from ``retromae_ds.hf.pooling`` when asked."""
    if name == "POOLINGS":
        return poolings.pooling_names()
    if name == "HEAD_POOLINGS":
        return poolings.head_pooling_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MODULES_FILE = "modules.json"
ROUTER_FILE = "router_config.json"
POOLING_DIR = "1_Pooling"
NORMALIZE_DIR = "2_Normalize"
LENGTH_FILE = "sentence_bert_config.json"

_MODULE = "sentence_transformers.models."
_MODE_PREFIX = "pooling_mode_"
_WRITTEN_MODES = (
    "pooling_mode_cls_token",
    "pooling_mode_mean_tokens",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
)
"""The mode flags every written ``1_Pooling/config.json`` holds (the pooling's own true)."""


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: str
    """A registered pooling's name (``retromae_ds.hf.pooling.POOLINGS``)."""
    normalize: bool
    max_length: int | None
    """Tokens per text the encoder was made to read (None: not recorded)."""
    source: str
    """Where the pooling was read: a file, or ``default``."""
    bow_topk: int = DEFAULT_BOW_TOPK
    """DupMAE poolings: entries of the bag-of-words vector kept (0: all)."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None


def _max_length(folder: Path) -> int | None:
    path = folder / LENGTH_FILE
    if not path.is_file():
        return None
    value = _read_json(path).get("max_seq_length")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ValueError(f"{path}: max_seq_length must be an integer >= 2, not {value!r}")
    return value


def _pooling_mode(path: Path) -> str:
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    used = [key for key, on in config.items() if key.startswith(_MODE_PREFIX) and on]
    found = [for_st_mode(key) for key in used]
    expressible = [p for p in poolings.registered() if p.st_mode is not None]
    if None in found:
        names = " or ".join(p.name for p in expressible)
        raise ValueError(f"{path}: {used[found.index(None)]} is not supported (only {names})")
    if len(found) != 1:
        flags = " / ".join(str(p.st_mode) for p in expressible)
        raise ValueError(f"{path}: exactly one of {flags} must be true (found {len(found)})")
    return found[0].name


def _module_name(kind: str) -> str:
    """``Transformer`` for ``sentence_transformers.models.Transformer`` and the class's other
    homes (``sentence_transformers.sentence_transformer.modules.transformer.Transformer``);
    a class outside sentence-transformers keeps its full name."""
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else kind


def _modules(folder: Path) -> list:
    path = folder / MODULES_FILE
    modules = _read_json(path)
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a JSON list of modules")
    return modules


def _from_modules(folder: Path) -> tuple[str, bool, str]:
    """(pooling, normalize, source file) from ``modules.json`` and the Pooling config."""
    path = folder / MODULES_FILE
    modules = _modules(folder)
    pooling, normalize, source = None, False, str(path)
    for i, module in enumerate(modules):
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        name = _module_name(kind)
        if name == "Transformer":
            continue
        if name == "Router" and i == 0:
            _routes(folder, module)  # checked: one Transformer per route
            continue
        if name == "Pooling":
            pooling_file = folder / str(module.get("path", POOLING_DIR)) / "config.json"
            pooling, source = _pooling_mode(pooling_file), str(pooling_file)
        elif name == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{path}: module {i} ({kind or module!r}) is not supported "
                "(only Transformer, Pooling and Normalize)"
            )
    if pooling is None:
        raise ValueError(f"{path}: no sentence_transformers.models.Pooling module")
    return pooling, normalize, source


def _routes(folder: Path, module: dict) -> dict[str, Path]:
    """``{route: its Transformer's folder}`` of the Router ``module`` of ``modules.json``: a
    ``ValueError`` naming ``router_config.json`` unless every route is one Transformer."""
    root = folder / str(module.get("path", ""))
    path = root / ROUTER_FILE
    config = _read_json(path)
    types = config.get("types") if isinstance(config, dict) else None
    structure = config.get("structure") if isinstance(config, dict) else None
    if not isinstance(types, dict) or not isinstance(structure, dict) or not structure:
        raise ValueError(f"{path}: expected a Router config with 'types' and 'structure'")
    routes = {}
    for route, ids in structure.items():
        kinds = [_module_name(str(types.get(i, ""))) for i in ids] if isinstance(ids, list) else []
        if kinds != ["Transformer"]:
            raise ValueError(
                f"{path}: route {route!r} is {kinds or ids!r}; only one Transformer per route "
                "is supported"
            )
        routes[str(route)] = root / str(ids[0])
    return routes


def routed_towers(folder: str | Path) -> tuple[Path, Path] | None:
    """(passage folder, query folder) of a folder whose ``modules.json`` starts with a Router
    routing ``query`` and ``document`` to two Transformers (see the module doc), else None."""
    folder = Path(folder)
    if not (folder / MODULES_FILE).is_file():
        return None
    modules = _modules(folder)
    first = modules[0] if modules and isinstance(modules[0], dict) else {}
    if _module_name(str(first.get("type", ""))) != "Router":
        return None
    routes = _routes(folder, first)
    if "query" not in routes or "document" not in routes:
        raise ValueError(
            f"{folder / str(first.get('path', '')) / ROUTER_FILE}: a Router without both a "
            f"'query' and a 'document' route (found {', '.join(routes)})"
        )
    passage, query = (Path(os.path.normpath(routes[r])) for r in ("document", "query"))
    return passage, query


def _topk(path: Path, settings: dict[str, Any]) -> int:
    value = settings.get("bow_topk", DEFAULT_BOW_TOPK)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{path}: bow_topk must be an integer >= 0, not {value!r}")
    return value


def read_spec(folder: str | Path) -> EmbeddingSpec:
    """The encoder's own pooling, normalisation and length (see the module docstring)."""
    folder = Path(folder)
    length = _max_length(folder)
    for name in (DUAL_ENCODER_FILE, DUPMAE_FILE):
        settings_file = folder / name
        if not settings_file.is_file():
            continue
        settings = _read_json(settings_file)
        if not isinstance(settings, dict):
            raise ValueError(f"{settings_file}: expected a JSON object")
        pooling = poolings.check_pooling(settings.get("pooling"), str(settings_file), auto=False)
        normalize = bool(settings.get("normalize"))
        topk = _topk(settings_file, settings)
        return EmbeddingSpec(pooling, normalize, length, str(settings_file), topk)
    if (folder / MODULES_FILE).is_file():
        pooling, normalize, source = _from_modules(folder)
        return EmbeddingSpec(pooling, normalize, length, source)
    return EmbeddingSpec(DEFAULT_POOLING, False, length, "default")


def check_pooling(pooling: str, auto: bool = True) -> str:
    """``pooling``'s canonical name; a ``ValueError`` naming the choices unless it is a
    registered pooling (or ``auto``)."""
    return poolings.check_pooling(pooling, "pooling", auto=auto)


def resolve(
    folder: str | Path,
    pooling: str = "auto",
    normalize: bool | None = None,
    bow_topk: int | None = None,
) -> EmbeddingSpec:
    """``read_spec(folder)`` with the explicit settings put over it (``auto`` / None: the
    folder's own)."""
    pooling = check_pooling(pooling)
    if bow_topk is not None and bow_topk < 0:
        raise ValueError(f"bow_topk must be >= 0, not {bow_topk}")
    spec = read_spec(folder)
    return EmbeddingSpec(
        spec.pooling if pooling == AUTO else pooling,
        spec.normalize if normalize is None else normalize,
        spec.max_length,
        spec.source,
        spec.bow_topk if bow_topk is None else bow_topk,
    )


def write_files(
    folder: Path,
    dim: int,
    pooling: str,
    max_length: int,
    *,
    normalize: bool,
    bow_topk: int = DEFAULT_BOW_TOPK,
    query_tower: str | None = None,
) -> None:
    """``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json`` (and the
    Normalize module when ``normalize``) into a Hugging Face encoder folder; for a pooling
    sentence-transformers cannot compute (DupMAE's: no ``st_mode``, or one that needs the MLM
    head) also ``dupmae_pooling.json``, with CLS pooling in the sentence-transformers files
    (see the module doc). ``query_tower``: the sub-folder holding a separate query tower (a
    Hugging Face folder already there): the first module is then a Router sending queries
    to it and documents to this folder's own weights."""
    chosen = get_pooling(check_pooling(pooling, auto=False))
    mode = chosen.st_mode
    if mode is None or chosen.needs_head:
        record = {
            "pooling": chosen.name,
            "normalize": normalize,
            "bow_topk": bow_topk,
            "note": "read by retromae_ds (HFEncoder.from_dir, retromae-ds eval); a plain "
            "SentenceTransformer load gives the [CLS] vector only",
        }
        (folder / DUPMAE_FILE).write_text(json.dumps(record, indent=2))
        mode = CLS.st_mode
    else:
        (folder / DUPMAE_FILE).unlink(missing_ok=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _MODULE + "Transformer"},
        {"idx": 1, "name": "1", "path": POOLING_DIR, "type": _MODULE + "Pooling"},
    ]
    if query_tower is not None:
        modules[0]["type"] = _MODULE + "Router"
        router = {
            "types": {query_tower: _MODULE + "Transformer", ".": _MODULE + "Transformer"},
            "structure": {"query": [query_tower], "document": ["."]},
            "parameters": {"default_route": "document", "allow_empty_key": True},
        }
        (folder / ROUTER_FILE).write_text(json.dumps(router, indent=2))
    else:
        (folder / ROUTER_FILE).unlink(missing_ok=True)
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": _MODULE + "Normalize"}
        )
        (folder / NORMALIZE_DIR).mkdir(exist_ok=True)
    (folder / MODULES_FILE).write_text(json.dumps(modules, indent=2))
    (folder / LENGTH_FILE).write_text(
        json.dumps({"max_seq_length": max_length, "do_lower_case": False}, indent=2)
    )
    (folder / POOLING_DIR).mkdir(exist_ok=True)
    config = {"word_embedding_dimension": dim, **{key: key == mode for key in _WRITTEN_MODES}}
    config[str(mode)] = True  # a registered pooling's mode beyond the usual four
    (folder / POOLING_DIR / "config.json").write_text(json.dumps(config, indent=2))
