"""The fine-tuning trainer's side: the prepared training data (``data``), the dual encoder and
its contrastive loss (``model``, ``loss``), the negatives it reads from the refresher's
hand-off (``handoff``, ``negatives``, ``feed``), its batches (``batches``), GradCache's step
for large batches in bounded memory (``grad_cache``) and the local refresher it starts beside
rank 0 (``local_refresher``).

The job is ``retromae_ds.finetune`` (``retromae-ds finetune``); the refresher process it talks
to is ``retromae_ds.refresher``; see docs/ance.md.
"""
