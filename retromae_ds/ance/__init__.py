"""The old home of fine-tuning (now ``retromae_ds.finetuning``, the trainer's side, and
``retromae_ds.refresher``, the refresher process). Kept only so that a command line written
before the split (``python -m retromae_ds.ance.refresher``, e.g. a Slurm job requeued with its
original script) goes on working."""
