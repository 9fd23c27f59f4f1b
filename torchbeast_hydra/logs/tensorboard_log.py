"""Metrics to TensorBoard: a sink beside logs.csv and wandb (`logger.tensorboard=true`).

`TensorboardLog` has CsvLog's interface (`write(row)`, `close()`), so `Stats` feeds it the same
rows: every numeric field is a scalar at x = the row's training `step`, in RUN_DIR/tensorboard/
(`tensorboard --logdir outputs` shows every run). A resumed run purges what the previous attempt
wrote past its checkpoint, so no step shows twice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.logs.wandb_log import numeric_fields

SUBDIR = "tensorboard"


class TensorboardLog:
    """A sink that writes rows as TensorBoard scalars (torch's SummaryWriter, event files)."""

    def __init__(self, run_dir: str | os.PathLike, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            raise ConfigError(
                "logger.tensorboard=true needs the tensorboard package: pip install tensorboard "
                "(or pip install -e '.[tensorboard]')."
            ) from None
        self.log_dir = Path(run_dir) / SUBDIR
        # purge_step: TensorBoard hides the events a crashed attempt logged at or after it.
        self._writer = SummaryWriter(str(self.log_dir), purge_step=resume_step + 1 if resume_step else None)

    def write(self, row: Mapping) -> None:
        metrics = numeric_fields(row)
        step = metrics.pop("step", None)
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_eval(self, row: Mapping) -> None:
        """An evaluation's figures (evaluation.periodic) as eval/*, at x = the training step it measured."""
        metrics = numeric_fields(row)
        step = metrics.pop("step")
        for key, value in metrics.items():
            self._writer.add_scalar(f"eval/{key}", value, global_step=step)

    def close(self) -> None:
        self._writer.close()
