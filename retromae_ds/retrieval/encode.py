"""Texts to embeddings: a Hugging Face encoder wrapped as a plain ``list[str] -> ndarray`` callable.

``HFEncoder.from_dir(folder, pooling="cls")`` loads a local model folder (``AutoTokenizer`` /
``AutoModel``, offline); ``HFEncoder(model, tokenizer)`` wraps a model already in memory (the
pre-training loop evaluating its own encoder). Calling it encodes in batches of texts of
similar length (longest first, so padding is small and an out-of-memory error shows at once),
under ``torch.inference_mode`` with a tqdm bar, and returns float32 ``[N, D]`` in input order.
Pooling is any registered one (``retromae_ds.hf.pooling``): the first token (``"cls"``, the
RetroMAE sentence embedding), the mask-weighted mean (``"mean"``, sentence-transformers
models), DupMAE's ordinary-token vector (``"dupmae_bow"``: the MLM head over each ordinary
token, max-pooled, its ``bow_topk`` largest entries kept, D = |V|), [CLS] and that vector
concatenated (``"dupmae"``, D = H + |V|, the paper's representation;
``retromae_ds.modeling.bow``), or an installed package's. A pooling that needs the MLM head
needs a masked-LM model; ``from_dir`` loads one for it. ``normalize`` scales rows to unit
length.

A text longer than ``cut_chars(max_length)`` characters is cut before it is tokenized
(``bounded_texts``: the tokenizer holds ~100 bytes a character, so one 10 MB document took
1.1 GB), keeping the same tokens: memory stays bounded whatever a document's length.

Anything else that maps a list of strings to an ``[N, D]`` array can stand in for it:
``encode_texts`` calls such an ``Encoder`` and checks what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from retromae_ds.data.rows import split_long_texts
from retromae_ds.hf import sbert
from retromae_ds.hf.pooling import DEFAULT_POOLING, get_pooling
from retromae_ds.hf.pooling import pool as pool  # the one definition, where callers met it
from retromae_ds.hf.util import load_tokenizer_checked
from retromae_ds.modeling.bow import bow_vectors
from retromae_ds.modeling.load import load_pretrained, load_with_head

Encoder = Callable[[list[str]], np.ndarray]


CHARS_PER_TOKEN = 16
"""Characters per token of ``max_length`` a text keeps before it is tokenized (English
WordPiece averages ~4-5); a denser text is given more (``bounded_texts``)."""
MIN_CUT_CHARS = 1 << 13
"""Texts of at most this many characters are tokenized whole, whatever ``max_length``."""
MAX_GROWTH = 16
"""A cut prefix with too few tokens grows up to this many times ``cut_chars``."""


def cut_chars(max_length: int) -> int:
    """Characters of a text handed to the tokenizer first at ``max_length`` tokens."""
    return max(MIN_CUT_CHARS, CHARS_PER_TOKEN * max_length)


def bounded_texts(tokenizer, texts: Sequence[str], max_length: int) -> list[str]:
    """``texts`` with each one longer than ``cut_chars(max_length)`` characters cut to a
    prefix that still holds more than ``max_length`` tokens, cut just before a whitespace
    character that precedes a word (``data.rows.split_long_texts``: there WordPiece behind
    BERT's pre-tokenizer and byte-level BPE give the same tokens as for the whole text), so
    that tokenized with truncation to ``max_length`` it gives the whole text's ids. A prefix
    with too few tokens is grown fourfold, up to ``MAX_GROWTH`` times the first cut: past
    that, a text still that sparse in tokens (one whitespace-free run of characters, such as
    an encoded blob) is cut there anyway, and memory stays bounded."""
    return [_bounded(tokenizer, text, max_length) for text in texts]


def _bounded(tokenizer, text: str, max_length: int) -> str:
    chars = first = cut_chars(max_length)
    while len(text) > chars:
        prefix = split_long_texts([text[: chars + 1]], chars)[0][0]
        if chars >= MAX_GROWTH * first:
            return prefix
        ids = tokenizer(
            prefix, add_special_tokens=False, truncation=True, max_length=max_length + 1
        )["input_ids"]
        if len(ids) > max_length:
            return prefix
        chars *= 4
    return text


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None -> cuda when available, else cpu; anything else as torch reads it."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HFEncoder:
    """A Hugging Face encoder as an ``Encoder`` callable.

    Args:
        model: a transformers model whose output has ``last_hidden_state`` (or a tuple whose
            first element is it). It is not moved unless ``device`` says so.
        tokenizer: the matching tokenizer (fast or slow).
        pooling: a registered pooling's name (``retromae_ds.hf.pooling``); one that needs
            the MLM head (``"dupmae_bow"``, ``"dupmae"``) needs a masked-LM ``model``: its
            head; the hidden states come from its body.
        normalize: L2-normalise the embeddings.
        bow_topk: DupMAE poolings: entries of the bag-of-words vector kept (0: all).
        max_length: tokens per text, special tokens included (longer texts are truncated,
            a very long one cut before it is tokenized: ``bounded_texts``); capped by the tokenizer's ``model_max_length`` and the model's position embeddings
            (``self.max_length`` is the length used, ``self.capped_by`` the limit that capped
            it, or None).
        batch_size: texts per forward pass.
        device: ``"auto"`` keeps the model where it is; otherwise the model is moved there.
        amp_dtype: run the forward pass under autocast with this dtype (e.g. bfloat16 on GPU).
        progress: show a progress bar.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        pooling: str = DEFAULT_POOLING,
        normalize: bool = False,
        bow_topk: int = sbert.DEFAULT_BOW_TOPK,
        max_length: int = 512,
        batch_size: int = 64,
        device: str | torch.device | None = "auto",
        amp_dtype: torch.dtype | None = None,
        progress: bool = True,
    ) -> None:
        pooling = sbert.check_pooling(pooling, auto=False)
        if bow_topk < 0:
            raise ValueError(f"bow_topk must be >= 0, got {bow_topk}")
        if max_length < 2 or batch_size < 1:
            raise ValueError(
                f"need max_length >= 2 and batch_size >= 1, got {max_length}, {batch_size}"
            )
        if device is not None and device != "auto":
            model = model.to(torch.device(device))
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        # never past what the tokenizer or the position embeddings support
        limits = {
            "the tokenizer's model_max_length": getattr(tokenizer, "model_max_length", None),
            "the model's position embeddings": _positions(model),
        }
        self.max_length, self.capped_by = max_length, None
        for reason, limit in limits.items():
            if isinstance(limit, int) and 0 < limit < self.max_length:
                self.max_length, self.capped_by = limit, reason
        self.pooling, self.normalize, self.batch_size = pooling, normalize, batch_size
        self.amp_dtype, self.progress, self.bow_topk = amp_dtype, progress, bow_topk
        if get_pooling(pooling).needs_head:
            self._check_head(pooling)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device | None = "auto",
        resolved: bool = False,
        **kwargs,
    ) -> HFEncoder:
        """Load a local model folder, a checkpoint's or a run's encoder
        (``checkpoint.resolve_encoder``; never downloads); kwargs as for the constructor.
        ``resolved``: ``model_dir`` is a Hugging Face folder the caller resolved and checked
        (``eval.towers``), loaded as it is. A folder without a usable tokenizer is a
        ``ValueError`` (``load_tokenizer_checked``). A DupMAE pooling loads the masked-LM
        model (a folder without an MLM head is a ``ValueError``) with the folder's own
        ``bow_topk`` unless one is given (any pooling that needs the MLM head)."""
        from transformers import AutoModel

        from retromae_ds.components.checkpoint import resolve_encoder

        if not resolved:  # a checkpoint's encoder checked against its record
            model_dir = resolve_encoder(model_dir)
        tokenizer = load_tokenizer_checked(model_dir)
        if get_pooling(kwargs.get("pooling", DEFAULT_POOLING)).needs_head:
            kwargs.setdefault("bow_topk", sbert.read_spec(model_dir).bow_topk)
            model = load_with_head(model_dir)
        else:
            model = load_pretrained(AutoModel, model_dir)  # an MLM folder: no pooler, expected
        return cls(model, tokenizer, device=resolve_device(device), **kwargs)

    def _check_head(self, pooling: str) -> None:
        from retromae_ds.modeling.encoder import mlm_head

        try:
            mlm_head(self.model)
        except TypeError:
            raise ValueError(
                f"pooling {pooling!r} needs the encoder's MLM head; {type(self.model).__name__} "
                "has none (load the masked-LM model: HFEncoder.from_dir does)"
            ) from None

    def dim_of(self, pooling: str) -> int:
        """Entries of one embedding with ``pooling``."""
        config = self.model.config
        return get_pooling(pooling).dim(int(config.hidden_size), int(config.vocab_size))

    @property
    def dim(self) -> int:
        return self.dim_of(self.pooling)

    def __call__(self, texts: Sequence[str], desc: str = "encode") -> np.ndarray:
        """Embeddings float32 ``[len(texts), D]``, row i for ``texts[i]``."""
        return self.encode_pools(texts, (self.pooling,), desc)[self.pooling]

    def encode_pools(
        self, texts: Sequence[str], poolings: Sequence[str], desc: str = "encode"
    ) -> dict[str, np.ndarray]:
        """One forward pass per batch, several poolings of it: ``{pooling: [len(texts), D]}``
        float32 (e.g. CLS and mean side by side at the cost of one encoding)."""
        if isinstance(poolings, str) or not poolings:
            raise ValueError(f"poolings: expected a list of poolings, got {poolings!r}")
        for name in poolings:
            if get_pooling(name, "poolings").needs_head:
                self._check_head(name)
        texts = list(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = {p: np.empty((len(texts), self.dim_of(p)), dtype=np.float32) for p in poolings}
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                torch.inference_mode(),
                tqdm(total=len(texts), desc=desc, unit="text", disable=not self.progress) as bar,
            ):
                for start in range(0, len(order), self.batch_size):
                    rows = order[start : start + self.batch_size]
                    for name, emb_BD in self._encode_batch(
                        [texts[i] for i in rows], poolings
                    ).items():
                        out[name][rows] = emb_BD
                    bar.update(len(rows))
        finally:
            self.model.train(was_training)
        return out

    def _encode_batch(self, texts: list[str], poolings: Sequence[str]) -> dict[str, np.ndarray]:
        batch = self.tokenizer(
            bounded_texts(self.tokenizer, texts, self.max_length),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        batch = {name: t.to(self.device) for name, t in batch.items()}
        body = getattr(self.model, "base_model", self.model)  # a masked-LM model's encoder
        bow_BV = None
        with torch.autocast(
            self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
        ):
            output = body(**batch)
            hidden_BLD = (
                output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            )
            if any(get_pooling(name).needs_head for name in poolings):
                special_ids = torch.tensor(sorted(set(self.tokenizer.all_special_ids)))
                bow_BV = bow_vectors(
                    self.model,
                    hidden_BLD,
                    batch["input_ids"],
                    batch["attention_mask"],
                    special_ids,
                    self.bow_topk,
                )
        out = {}
        for name in poolings:
            emb_BD = get_pooling(name)(hidden_BLD, batch["attention_mask"], bow_BV).float()
            if self.normalize:
                emb_BD = torch.nn.functional.normalize(emb_BD, dim=-1)
            out[name] = emb_BD.cpu().numpy()
        return out


def encode_texts(encoder: Encoder, texts: Sequence[str], desc: str = "encode") -> np.ndarray:
    """Call ``encoder`` on ``texts`` and check its answer: float32 ``[len(texts), D]``, finite."""
    texts = list(texts)
    result = encoder(texts, desc=desc) if isinstance(encoder, HFEncoder) else encoder(texts)
    if isinstance(result, torch.Tensor):
        result = result.detach().float().cpu().numpy()
    result = np.asarray(result)
    if result.ndim != 2 or result.shape[0] != len(texts):
        raise ValueError(
            f"encoder returned shape {result.shape} for {len(texts)} texts; expected [{len(texts)}, D]"
        )
    if not np.issubdtype(result.dtype, np.floating):
        raise ValueError(f"encoder returned dtype {result.dtype}; expected floating point")
    result = np.ascontiguousarray(result, dtype=np.float32)
    if not np.isfinite(result).all():
        raise ValueError("encoder returned NaN or infinite values")
    return result


def _positions(model: torch.nn.Module) -> int | None:
    """Usable positions of a BERT-family model (RoBERTa's offset rows excluded), or None."""
    from retromae_ds.modeling.positions import usable_positions

    try:
        return usable_positions(model)
    except TypeError:  # no absolute position table: the config's word, if any
        return getattr(getattr(model, "config", None), "max_position_embeddings", None)
