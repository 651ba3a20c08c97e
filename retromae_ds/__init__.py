"""retromae-ds: DeepSpeed pre-training of dense-retrieval encoders (RetroMAE, SEED-Encoder,
MLM), ANCE fine-tuning, evaluation and export."""

__version__ = "0.1.0"
