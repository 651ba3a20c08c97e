"""ANCE fine-tuning support: the negatives hand-off, hard-negative mining, the training data
and loss of the dual encoder, and the asynchronous refresher (``retromae-ds refresh``).

The trainer is ``retromae_ds.finetune`` (``retromae-ds finetune``); see docs/ance.md.
"""
