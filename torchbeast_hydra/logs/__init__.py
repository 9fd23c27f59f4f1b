"""logs: where figures go and how they are read back. The stats a run keeps and logs.csv
(metrics.py, also the one reader of those csvs), wandb (wandb_log.py), TensorBoard (tensorboard_log.py),
what a sweep fixed (sweep_record.py); reading runs and sweeps into pandas (runs.py), plots (plots.py),
the plot command (plot_command.py), the report with aggregate scores (report.py, scores.py, baselines.yaml).
settings.py: the logger config.

May import: errors only (it reads runs from disk, never the training code).
"""
