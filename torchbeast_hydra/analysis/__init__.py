"""Moved to torchbeast_hydra.logs (runs.py: the reader of runs and sweeps, plots.py); this path
keeps notebooks and scripts written before the move working. Remove in 0.3.

    from torchbeast_hydra.logs import runs, plots
"""

from torchbeast_hydra.logs import plots, runs  # noqa: F401
from torchbeast_hydra.logs.runs import *  # noqa: F403
