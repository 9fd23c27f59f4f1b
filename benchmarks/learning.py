"""Learning: does IMPALA solve CartPole-v1 (mean return >= 475 over 100 episodes) in 500k steps?

    python benchmarks/learning.py                 # seeds 1 2 3, the cartpole preset, mono and poly
    python benchmarks/learning.py --backends poly --seeds 1 2 3 4 5 backend.num_actors=4

Prints, per seed, the first step and wall time at which the mean of the last 100 episode returns
reached the target, and the best such mean.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import platform_line, read_log, train  # noqa: E402


def time_to_target(rows: list, target: float, window: int = 100):
    """(step, seconds) when the mean of the last `window` returns first reached target; best mean."""
    recent = collections.deque(maxlen=window)
    best, reached = float("-inf"), None
    for row in rows:
        recent.extend(row["episode_returns"])
        if len(recent) == window:
            mean = sum(recent) / window
            best = max(best, mean)
            if reached is None and mean >= target:
                reached = (row["step"], row["time_s"])
    return reached, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--backends", nargs="+", default=["mono", "poly"], choices=["mono", "poly"])
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides on top of experiment=cartpole")
    args = parser.parse_args()

    print(f"machine: {platform_line()}")
    print(f"config:  experiment=cartpole {' '.join(args.overrides)}")
    for backend in args.backends:
        solved = 0
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(tmp) / "run"
                overrides = ["experiment=cartpole", f"backend={backend}", f"seed={seed}", *args.overrides]
                rc, wall, _ = train(run_dir, overrides)
                rows = read_log(run_dir)
            reached, best = time_to_target(rows, args.target)
            if reached:
                solved += 1
                result = f"mean return >= {args.target:g} at step {reached[0]:,} after {reached[1]:.0f} s"
            else:
                result = f"target not reached in {rows[-1]['step']:,} steps"
            print(
                f"{backend} seed {seed}: {result}; best mean {best:.1f}; run took {wall:.0f} s (exit {rc})", flush=True
            )
        print(f"{backend}: solved {solved}/{len(args.seeds)} seeds", flush=True)


if __name__ == "__main__":
    main()
