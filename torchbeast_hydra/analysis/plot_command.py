"""`python -m torchbeast_hydra.analysis RUNS_DIR [--out DIR]` (or `torchbeast-hydra-plot`): the
analysis notebook's plots and table from the command line.

RUNS_DIR: run dirs and/or multirun (sweep) dirs, one or several; default: the newest under outputs/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from torchbeast_hydra.analysis import figures, runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchbeast-hydra-plot",
        description="Learning curves (return, SPS, losses; seeds aggregated per swept setting) "
        "and a table of final returns for a run or a sweep.",
    )
    parser.add_argument(
        "runs_dirs",
        nargs="*",
        metavar="RUNS_DIR",
        help="run dirs and/or multirun dirs, compared together (default: the newest under outputs/)",
    )
    parser.add_argument(
        "--out",
        help="where to write the PNGs and final_returns.csv (default: RUNS_DIR/plots, or their common parent's)",
    )
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
        runs_dirs = [Path(d) for d in args.runs_dirs] or [runs.latest_runs_dir()]
        df = runs.load_runs(runs_dirs, window=args.window)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.out:
        out_dir = Path(args.out)
    else:
        out_dir = runs_dirs[0] if len(runs_dirs) == 1 else Path(os.path.commonpath([d.resolve() for d in runs_dirs]))
        out_dir = out_dir / "plots"
    paths = figures.plot_all(df, out_dir, last_n=args.last_n, bins=args.bins)
    count = df["run"].nunique()
    print(f"{count} run{'s' * (count != 1)} in {', '.join(map(str, runs_dirs))}; swept: {swept_line(df)}")
    with pd.option_context("display.width", 120, "display.max_columns", 10):
        print(f"\nFinal return (mean of the last {args.last_n} episodes of each run):")
        print(runs.final_returns_by_setting(df, args.last_n).to_string(float_format="%.2f"))
    print()
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def swept_line(df: pd.DataFrame) -> str:
    """`optim.learning_rate, seed (seeds aggregated per setting)`; `nothing` for identical runs."""
    keys = df.attrs["swept_keys"]
    if runs.SEED in df.attrs["swept"]:
        return f"{', '.join([*keys, runs.SEED])} ({'seeds aggregated per setting' if keys else 'aggregated'})"
    return ", ".join(keys) or "nothing"


if __name__ == "__main__":
    sys.exit(main())
