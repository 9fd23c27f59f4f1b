"""`python -m torchbeast_hydra.analysis RUNS_DIR`: the plot command (plot_command.py)."""

import sys

from torchbeast_hydra.analysis.plot_command import main

if __name__ == "__main__":
    sys.exit(main())
