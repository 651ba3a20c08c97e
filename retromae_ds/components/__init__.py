"""The training run's parts, each with matching save and load where it holds state:
``checkpoint`` (CheckpointManager: the verified, atomic checkpoints and resume), ``engine``
(the DeepSpeed engine: config, process group, save/load), ``layout`` (RunLayout: where a
run's files live), ``metrics_log`` (metrics.jsonl appended and read back), ``run_lock`` (one
writer per run folder), ``signals`` (stop requests turned into a checkpoint and a clean
exit) and ``optim`` (AdamW groups and the learning-rate schedule). ``training.loop`` drives
them; jobs (``pretrain``, ``finetune``) only configure them."""
