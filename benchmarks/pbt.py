"""Population-based training against a random search over the same ranges, at the same agent steps.

    python benchmarks/pbt.py                                  # CartPole, 8 members, seeds 1 2 3
    python benchmarks/pbt.py --seeds 1 2 3 4 5 --steps 100000 --interval 10000
    python benchmarks/pbt.py --report-only                    # the figures and table from the runs kept

For each seed, two multiruns of `pbt=default pbt.population=8 pbt.start=resample`, on CartPole-v1
with experiment=cartpole's settings: one population (pbt.exploit=true), and the same 8 starting
configurations (the same draws: they follow the seed and the member) trained fixed
(pbt.exploit=false). The learning rate is drawn log-uniformly from [1e-4, 3e-2] (RANGES) and the
entropy cost from [1e-4, 0.1] (pbt=default's): at this budget about half the draws learn CartPole
slowly or not at all, so the fixed search's best is luck, and a population can pass its best on.
Each arm spends members x steps agent steps.

The score of an arm is its best member's: the mean return of its last 100 training episodes at the
end (the objective the population ranks by, pbt.objective=train). Printed per seed, then the mean
over seeds with a 95% bootstrap interval of each arm and of their difference (few seeds: say so).
A multirun's members run in parallel (hydra/launcher=submitit_local); each multirun resumes when the
script is run again (finished members resume at their end), so an interrupted benchmark goes on.
Runs go to --out (default docs/reports/pbt/runs) and the report (curves, lineage, the best member's
schedule: torchbeast_hydra.analysis.report) to --report (default docs/reports/pbt).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from torchbeast_hydra.logs.metrics import read_rows
from torchbeast_hydra.pbt import population

REPO = Path(__file__).resolve().parent.parent
ARMS = {"pbt": "pbt.exploit=true", "fixed": "pbt.exploit=false"}
# The learning rate's range, wider than pbt=default's upwards: Adam learns CartPole's MLP fastest
# near 1e-2, and draws below 1e-3 learn little within the budget.
RANGES = ("pbt.mutate.optim.learning_rate.low=0.0001", "pbt.mutate.optim.learning_rate.high=0.03")


def command(out: Path, seed: int, arm: str, args) -> list[str]:
    return [
        sys.executable, "-m", "torchbeast_hydra", "-m",
        "experiment=cartpole", "pbt=default", f"pbt.population={args.members}", "pbt.start=resample",
        *RANGES, ARMS[arm], f"seed={seed}", f"total_steps={args.steps}", f"pbt.interval_steps={args.interval}",
        "backend.num_actors=1", "logger.wandb.mode=disabled", "logger.log_interval_s=30",
        "eval.interval_steps=0",  # the training mean is the objective and the measure: no evaluation processes
        f"hydra/launcher={args.launcher}", *(["hydra.launcher.timeout_min=600"] if args.launcher != "basic" else []),
        f"hydra.sweep.dir={out / arm / f'seed{seed}'}",
    ]  # fmt: skip


def final_train_mean(run_dir: Path, window: int = 100) -> float:
    """The mean return of a run's last `window` training episodes (logs.csv)."""
    returns = [r for row in read_rows(run_dir / "logs.csv") for r in row["episode_returns"]]
    return float(np.mean(returns[-window:])) if returns else float("nan")


def arm_scores(sweep_dir: Path, members: int, steps: int) -> list[float] | None:
    """Each member's final training mean, or None while a member has not reached `steps`."""
    scores = []
    for member in range(members):
        run_dir = sweep_dir / f"pbt.member={member}"
        rows = read_rows(run_dir / "logs.csv") if (run_dir / "logs.csv").exists() else []
        if not rows or rows[-1]["step"] < steps:
            return None
        scores.append(final_train_mean(run_dir))
    return scores


def bootstrap(values: np.ndarray, reps: int = 10_000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = rng.choice(values, size=(reps, len(values))).mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarise(out: Path, args) -> None:
    best = {arm: {} for arm in ARMS}
    for seed in args.seeds:
        line = [f"seed {seed}:"]
        for arm in ARMS:
            scores = arm_scores(out / arm / f"seed{seed}", args.members, args.steps)
            if scores is None:
                line.append(f"{arm} unfinished")
                continue
            best[arm][seed] = max(scores)
            line.append(f"{arm} best {max(scores):7.1f} (members {' '.join(f'{s:.0f}' for s in scores)})")
        pbt_dir = out / "pbt" / f"seed{seed}" / "pbt"
        if population.is_population(pbt_dir):
            exploits = sum(row["event"] == "exploit" for row in population.read_table(pbt_dir))
            line.append(f"exploits {exploits}")
        print("  ".join(line))
    both = [seed for seed in args.seeds if all(seed in best[arm] for arm in ARMS)]
    if not both:
        print("No seed finished in both arms yet.")
        return
    print(f"{len(both)} seed(s) finished in both arms (few seeds: the intervals are wide):")
    for arm in ARMS:
        values = np.array([best[arm][s] for s in both])
        low, high = bootstrap(values)
        print(f"  {arm:5s} best member: mean {values.mean():.1f}, 95% bootstrap CI [{low:.1f}, {high:.1f}]")
    difference = np.array([best["pbt"][s] - best["fixed"][s] for s in both])
    low, high = bootstrap(difference)
    print(f"  pbt - fixed: mean {difference.mean():.1f}, 95% bootstrap CI [{low:.1f}, {high:.1f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30_000, help="agent steps per member")
    parser.add_argument("--interval", type=int, default=3_000, help="pbt.interval_steps")
    parser.add_argument("--launcher", default="submitit_local", help="hydra/launcher (basic: members in turn)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "reports" / "pbt" / "runs")
    parser.add_argument("--report", type=Path, default=REPO / "docs" / "reports" / "pbt")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        for seed in args.seeds:
            for arm in ARMS:
                if arm_scores(args.out / arm / f"seed{seed}", args.members, args.steps) is not None:
                    continue  # done: a later run of the script skips it
                argv = command(args.out, seed, arm, args)
                print("$", " ".join(argv[1:]), flush=True)
                subprocess.run(argv, cwd=REPO, check=False)
                summarise(args.out, args)
    summarise(args.out, args)
    sweeps = [args.out / arm / f"seed{seed}" for arm in ARMS for seed in args.seeds]
    sweeps = [sweep for sweep in sweeps if sweep.is_dir()]
    if sweeps:
        report = [sys.executable, "-m", "torchbeast_hydra.analysis.report", *map(str, sweeps)]
        subprocess.run([*report, "--metric", "train", "--out", str(args.report)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
