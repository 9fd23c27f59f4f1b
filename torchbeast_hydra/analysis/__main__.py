"""`python -m torchbeast_hydra.analysis RUNS_DIR [--out DIR]` (or `torchbeast-hydra-plot`): the
analysis notebook's plots and table from the command line.

RUNS_DIR is one run dir or a multirun (sweep) dir; default: the newest under outputs/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from . import plots, runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchbeast-hydra-plot",
        description="Learning curves (return, SPS, losses; seeds aggregated per swept setting) "
        "and a table of final returns for a run or a sweep.",
    )
    parser.add_argument("runs_dir", nargs="?", help="a run dir or a multirun dir (default: the newest under outputs/)")
    parser.add_argument("--out", help="where to write the PNGs and final_returns.csv (default: RUNS_DIR/plots)")
    parser.add_argument(
        "--last-n", type=int, default=100, help="final return: the mean of each run's last N episodes (default 100)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=100,
        help="return curve: the mean of the last N episodes at each step (default 100)",
    )
    parser.add_argument("--bins", type=int, default=100, help="points per curve (default 100)")
    args = parser.parse_args(argv)

    try:
        runs_dir = Path(args.runs_dir) if args.runs_dir else runs.latest_runs_dir()
        df = runs.load_runs(runs_dir, window=args.window)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else runs_dir / "plots"
    paths = plots.plot_all(df, out_dir, last_n=args.last_n, bins=args.bins)
    count = df["run"].nunique()
    print(f"{count} run{'s' * (count != 1)} in {runs_dir}; swept: {', '.join(df.attrs['swept_keys']) or 'nothing'}")
    with pd.option_context("display.width", 120, "display.max_columns", 10):
        print(f"\nFinal return (mean of the last {args.last_n} episodes of each run):")
        print(runs.final_returns_by_setting(df, args.last_n).to_string(float_format="%.2f"))
    print()
    for path in paths.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
