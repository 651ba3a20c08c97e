"""What pre-training and fine-tuning share: the run config, the optimizer and schedule, the
stop/requeue protocol and the one optimizer-step loop (``Trainer``)."""
