"""``retromae-ds refresh``: the asynchronous hard-negative refresher of a fine-tuning run, as
a job (``retromae_ds.refresher.process`` is its loop; ``python -m retromae_ds.refresh`` is
what the trainer's local refresher and slurm/finetune.sh start)."""

from __future__ import annotations

import errno
import sys

from retromae_ds.base.commands import DESCRIPTIONS
from retromae_ds.base.options import run_command
from retromae_ds.components.layout import RunLayout
from retromae_ds.finetuning import handoff
from retromae_ds.refresher.config import RefreshConfig, RefresherConfig
from retromae_ds.refresher.process import run_refresher


def refresh_command(cfg: RefreshConfig) -> None:
    """``retromae-ds refresh``: :func:`run_refresher`, a failed negatives write reported with
    what the user can do about it (free space on a full disk; make a read-only or
    permission-denied folder writable)."""
    try:
        run_refresher(cfg)
    except handoff.NegativesWriteError as exc:
        if exc.errno in handoff.NOT_WRITABLE:
            fix = f"make {RunLayout(cfg.run_dir).negatives} writable"
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there"
        else:
            fix = "fix that"
        error = handoff.NegativesWriteError(
            f"{exc}; the trainer trains on with the version it has: {fix} and start the "
            "refresher again (a resumed fine-tuning starts its local one)"
        )
        error.errno = exc.errno
        raise error from exc


def main(argv: list[str] | None = None) -> int:
    """``python -m retromae_ds.refresh`` (the trainer's local refresher and slurm/finetune.sh
    start it so): the same command as ``retromae-ds refresh``; one error line, exit 2 for bad
    input and 1 for files, a traceback only with ``RETROMAE_DS_DEBUG`` on
    (``errors.run_reporting``)."""
    return run_command(
        RefresherConfig,
        refresh_command,
        argv,
        prog="retromae-ds refresh",
        description=DESCRIPTIONS["refresh"],
    )


if __name__ == "__main__":
    sys.exit(main())
