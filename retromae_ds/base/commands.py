"""One description per command: ``retromae-ds NAME --help``, the front door's list
(``cli``) and a job's own ``python -m`` path (``retromae_ds.pretrain`` under a launcher,
``retromae_ds.refresher.process`` started by the trainer) all read it here, so both spellings
describe the command the same way."""

DESCRIPTIONS = {
    "pretrain": "RetroMAE / DupMAE / SEED-Encoder / bowdpr / MLM pre-training on DeepSpeed",
    "finetune": "dense-retrieval fine-tuning with ANCE hard negatives on DeepSpeed",
    "refresh": "the asynchronous hard-negative refresher of a fine-tuning run",
    "mine": "offline hard negatives of a BEIR split or a pairs file, as a file every tool reads",
    "preprocess": "raw text -> memory-mapped Arrow shards",
    "make-tokenizer": "a BERT fast-tokenizer folder from a WordPiece vocab.txt",
    "train-tokenizer": "train a WordPiece tokenizer on inputs",
    "inspect": "summary of a shards folder",
    "export": "encoder of a checkpoint -> Hugging Face folder",
    "long-task": "a long-document BEIR task from WikiText articles (title / deep sentence)",
    "eval": "retrieval metrics of an encoder on a BEIR folder",
}
