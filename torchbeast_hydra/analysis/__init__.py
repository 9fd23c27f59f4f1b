"""Analysis: runs and sweeps read back from disk, their plots, and the plot command.

runs.py      logs.csv + .hydra/ of each run into one pandas DataFrame; what differs is swept; seeds aggregated
plots.py     learning-curve and final-return figures (PNG), without pyplot's global state
__main__.py  `python -m torchbeast_hydra.analysis RUNS_DIR...` (or `torchbeast-hydra-plot`)

    from torchbeast_hydra.analysis import load_runs, plots
"""

from .runs import (
    ALL_RUNS,
    RETURN,
    SEED,
    differing_keys,
    episode_returns,
    final_returns,
    final_returns_by_setting,
    find_runs,
    latest_runs_dir,
    learning_curve,
    load_run,
    load_runs,
    loss_columns,
    read_config,
    read_overrides,
    read_seed,
    settings,
    swept_keys,
)

__all__ = [
    "ALL_RUNS",
    "RETURN",
    "SEED",
    "differing_keys",
    "episode_returns",
    "final_returns",
    "final_returns_by_setting",
    "find_runs",
    "latest_runs_dir",
    "learning_curve",
    "load_run",
    "load_runs",
    "loss_columns",
    "read_config",
    "read_overrides",
    "read_seed",
    "settings",
    "swept_keys",
]
