"""Data-parallel scaling: CartPole with 1 and 2 ranks (distributed.nproc), several seeds.

    python benchmarks/ranks.py                                   # ranks 1 2, seeds 1 2 3, target 400
    python benchmarks/ranks.py --ranks 1 2 4 --seeds 1 2 --target 475 total_steps=500000

Each run is `python -m torchbeast_hydra experiment=cartpole distributed.nproc=N seed=S` (plus the
given overrides) in a run dir of its own under --out. Prints, per run, the agent steps at which the
mean return of the last 100 episodes first reached --target (steps summed over ranks: logs.csv's
step column) and the job's agent steps/s over the whole run; then the median over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from torchbeast_hydra.logs.metrics import read_rows, recent_means

BASE = ["experiment=cartpole", "eval.interval_steps=0", "eval.final=false", "logger.wandb.mode=disabled"]


def steps_to_target(rows: list, target: float) -> int | None:
    means = recent_means(row["episode_returns"] for row in rows)
    return next((row["step"] for row, mean in zip(rows, means) if mean is not None and mean >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--target", type=float, default=400.0)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/ranks"))
    args, overrides = parser.parse_known_args()
    results = {}
    for ranks in args.ranks:
        for seed in args.seeds:
            run_dir = args.out / f"ranks{ranks}-seed{seed}"
            command = [sys.executable, "-m", "torchbeast_hydra", f"hydra.run.dir={run_dir}", *BASE]
            command += [f"distributed.nproc={ranks}", f"seed={seed}", *overrides]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
            rows = read_rows(run_dir)
            sps = rows[-1]["step"] / rows[-1]["time_s"]
            reached = steps_to_target(rows, args.target)
            results.setdefault(ranks, []).append(reached)
            line = f"ranks={ranks} seed={seed}: steps to {args.target:g}: {reached}, {sps:,.0f} agent steps/s"
            print(line, flush=True)
    for ranks, reached in results.items():
        known = [r for r in reached if r is not None]
        median = f"{statistics.median(known):,.0f}" if known else "never"
        print(f"ranks={ranks}: median steps to {args.target:g} over {len(known)}/{len(reached)} seeds: {median}")


if __name__ == "__main__":
    main()
