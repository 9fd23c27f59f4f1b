"""logs: where figures go and how they are read back. The stats a run keeps and logs.csv
(metrics.py), wandb (wandb_log.py), TensorBoard (tensorboard_log.py), and the one reader of runs
and sweeps (runs.py) with plots (plots.py) and the plot command (plot_command.py).
settings.py: the logger config.

May import: errors only (it reads runs from disk, never the training code).
"""

from torchbeast_hydra.logs import plots, runs  # noqa: F401  (logs.runs, logs.plots for notebooks)
