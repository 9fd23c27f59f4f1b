"""`python -m torchbeast_hydra.analysis` is the plot command, torchbeast_hydra.logs.plot_command."""

import sys

from torchbeast_hydra.logs.plot_command import main

if __name__ == "__main__":
    sys.exit(main())
