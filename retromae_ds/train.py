"""The old name of ``retromae_ds.pretrain`` (pre-training): command lines written before the
rename (``python -m retromae_ds.train``, a Slurm job requeued with its original script) and
``from retromae_ds.train import TrainConfig`` (now ``PretrainConfig``) and ``train`` (now
``pretrain``) go on working. New code uses ``retromae_ds.pretrain``."""

from __future__ import annotations

import sys

from retromae_ds.pretrain import PretrainConfig, main, pretrain

TrainConfig = PretrainConfig
train = pretrain

__all__ = ["TrainConfig", "main", "train"]

if __name__ == "__main__":
    sys.exit(main())
