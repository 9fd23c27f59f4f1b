"""Population-based training against the best of a random search over the same ranges, at the same agent steps.

    python benchmarks/pbt.py                                  # Acrobot-v1, 8 members, seeds 1 2 3
    python benchmarks/pbt.py --seeds 1 2 3 4 5 --steps 150000 --interval 10000
    python benchmarks/pbt.py --report-only                    # the summary, figures and table from the runs kept
    python benchmarks/pbt.py --task LunarLander-v3 --steps 300000 --out DIR --report DIR  # another task

The task (--task, an env id; Acrobot-v1 by default, the first two tests' task, docs/pbt.md):
Acrobot-v1 (experiment=suite_classic's task) on experiment=cartpole's settings, where the
hyperparameters decide whether it learns at all: at the preset's reward scale (1) it never does
(docs/results.md, the laptop suite: the critic's errors swamp the shared MLP), at 0.1 it does by
~100k steps, and at a learning rate of 1e-3 one seed of five did not. Three live keys are drawn
log-uniformly per member (pbt.start=resample, seeded by the seed and the member): the learning rate
from [1e-4, 3e-2], the entropy cost from [1e-4, 0.1] (pbt=default's) and the reward scale from
[0.01, 1] (RANGES). Per seed, two multiruns of 8 members start from the same 8 draws: a population
(pbt.exploit=true) and the same configurations kept fixed (pbt.exploit=false: a random search).
Each arm spends members x steps agent steps; the members run side by side (submitit_local).

The measure (--measure, chosen before a test runs; docs/pbt.md says which each test used):
- greedy (the first three tests): each arm picks its member by its own ranking (the best latest
  published score in its pbt.csv: the mean training return over its last interval, what mode=test
  plays), and that member's final weights play --episodes greedy episodes (mode=test);
- train: each arm's best member by the mean return of its last 100 training episodes at the budget
  (sampled actions, the peers' measure): the best of 8 fixed configurations against the
  population's best.
Per seed the figure is pbt - fixed; over seeds, the mean with a 95% paired t interval (it assumes
the per-seed differences are normal; with 3 seeds it is wide), and Wilcoxon's signed-rank test,
exact and two-sided, with the Hodges-Lehmann estimate and its 95% interval (the pre-set analysis
since the second test, docs/pbt.md). Also printed, not the claim: the other measure, and each arm's
mean member by its final training mean. While it trains the script prints only each arm's time:
the figures and the report come once every seed asked for is played in both arms (--report-only
gives them whenever asked), so a test set beforehand is read once, whole.

Runs go to --out (default docs/reports/pbt/runs: <arm>/seed<N> the multiruns, test/<arm>/seed<N>
the greedy plays); once an arm's member is played, its checkpoints and submitit files are deleted
(logs only). A finished arm is skipped when the script is run again, so an interrupted benchmark
goes on where it stopped. The report (curves, lineage, the best member's schedule:
torchbeast_hydra.analysis.report) goes to --report (default docs/reports/pbt).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from torchbeast_hydra.analysis import runs
from torchbeast_hydra.logs.metrics import KEPT_LOGS, LOGS, logs_file, read_rows
from torchbeast_hydra.pbt import population

REPO = Path(__file__).resolve().parent.parent
ARMS = {"pbt": "pbt.exploit=true", "fixed": "pbt.exploit=false"}
TEXT_LOG = "torchbeast.log"  # each run's text log (Hydra's job logging), not kept
PRESET = "experiment=cartpole"  # an MLP on experiment=cartpole's settings, for each --task
RANGES = (
    "pbt.mutate.optim.learning_rate.low=0.0001",
    "pbt.mutate.optim.learning_rate.high=0.03",
    "+pbt.mutate.vtrace.reward_scale={low:0.01,high:1.0}",
)  # and the entropy cost's, pbt=default's [1e-4, 0.1]
# Two-sided 95% Student t quantiles by degrees of freedom (seeds - 1).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def train_command(out: Path, seed: int, arm: str, args) -> list[str]:
    return [
        sys.executable, "-m", "torchbeast_hydra", "-m", PRESET, f"env.id={args.task}",
        "pbt=default", f"pbt.population={args.members}", "pbt.start=resample", *RANGES, ARMS[arm],
        f"seed={seed}", f"total_steps={args.steps}", f"pbt.interval_steps={args.interval}",
        # 8 members on a 2-core box: one actor and one torch thread each.
        "backend.num_actors=1", "backend.learner_torch_threads=1",
        "logger.wandb.mode=disabled", "logger.log_interval_s=30",
        "eval.interval_steps=0",  # the members rank by training returns; the chosen one is played at the end
        f"hydra/launcher={args.launcher}", *(["hydra.launcher.timeout_min=600"] if args.launcher != "basic" else []),
        f"hydra.sweep.dir={out / arm / f'seed{seed}'}",
    ]  # fmt: skip


def test_command(out: Path, seed: int, arm: str, args) -> list[str]:
    """mode=test on the arm's population dir: plays the member with the best latest published score."""
    return [
        sys.executable, "-m", "torchbeast_hydra", PRESET, f"env.id={args.task}",
        "mode=test", f"load_dir={out / arm / f'seed{seed}' / 'pbt'}",
        f"test.num_episodes={args.episodes}", "logger.wandb.mode=disabled",
        f"hydra.run.dir={out / 'test' / arm / f'seed{seed}'}",
    ]  # fmt: skip


def final_train_mean(run_dir: Path, window: int = 100) -> float:
    """The mean return of a run's last `window` training episodes (logs.csv)."""
    returns = [r for row in read_rows(run_dir) for r in row["episode_returns"]]
    return float(np.mean(returns[-window:])) if returns else float("nan")


def member_scores(sweep_dir: Path, members: int, steps: int) -> list[float] | None:
    """Each member's final training mean, or None while a member has not reached `steps`."""
    scores = []
    for member in range(members):
        run_dir = sweep_dir / f"pbt.member={member}"
        rows = read_rows(run_dir) if logs_file(run_dir) is not None else []
        if not rows or rows[-1]["step"] < steps:
            return None
        scores.append(final_train_mean(run_dir))
    return scores


def played(test_dir: Path) -> float | None:
    """The greedy mean return of the member an arm picked (its mode=test eval.csv), None before it is played."""
    path = test_dir / "eval.csv"
    rows = read_rows(path) if path.exists() else []
    return float(rows[-1]["mean_return"]) if rows else None


def thin(sweep_dir: Path, test_dir: Path) -> None:
    """What a report reads, as a report's kept runs are: no checkpoints (the members' and the
    published ones), submitit's pickles, links or text logs (torchbeast.log: its figures are in
    logs.csv, its lineage in pbt.csv); of each member's logs.csv the columns the report and this
    summary read (runs.REPORT_COLUMNS), gzipped (logs.csv.gz); of its .hydra/hydra.yaml the config
    group choices."""
    for path in [*sweep_dir.rglob("checkpoint*.pt"), *sweep_dir.rglob(TEXT_LOG), *test_dir.glob(TEXT_LOG)]:
        path.unlink()
    for logs in sweep_dir.glob(f"pbt.member=*/{LOGS}"):
        runs.write_report_columns(logs, logs.with_name(KEPT_LOGS))
        logs.unlink()
    for hydra_yaml in sweep_dir.glob("pbt.member=*/.hydra/hydra.yaml"):
        runs.write_hydra_choices(hydra_yaml, hydra_yaml)
    shutil.rmtree(sweep_dir / ".submitit", ignore_errors=True)
    for path in [*test_dir.iterdir(), *sweep_dir.rglob("*")]:
        if path.is_symlink():
            path.unlink()


def t_interval(values: np.ndarray) -> tuple[float, float]:
    if len(values) < 2:
        return float("nan"), float("nan")
    # Past 10 degrees of freedom, 10's quantile: a little wider than the true one, never narrower.
    half = T95[min(len(values) - 1, 10)] * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean() - half), float(values.mean() + half)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ordered = values[order]
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and ordered[end + 1] == ordered[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def signed_rank_null(ranks: np.ndarray) -> np.ndarray:
    """Every value the sum of positive ranks takes under the null (each sign + or - alike): one per sign
    pattern, all 2^n of them (exact; n <= 20 here)."""
    if len(ranks) > 20:
        raise ValueError("the exact signed-rank distribution enumerates 2^n patterns: at most 20 differences")
    patterns = (np.arange(2 ** len(ranks))[:, None] >> np.arange(len(ranks))) & 1
    return patterns @ ranks


def signed_rank_test(differences) -> tuple[float, int]:
    """Wilcoxon's signed-rank test of paired differences: (exact two-sided p, differences used). Zeros
    are dropped (a tie says nothing of which arm is ahead); tied sizes share their mean rank."""
    d = np.asarray([x for x in differences if x != 0], float)
    if not len(d):
        return 1.0, 0
    ranks = average_ranks(np.abs(d))
    centre = ranks.sum() / 2
    null = signed_rank_null(ranks)
    observed = abs(ranks[d > 0].sum() - centre)
    return float(np.mean(np.abs(null - centre) >= observed - 1e-9)), len(d)


def hodges_lehmann(differences, level: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high): the median of the Walsh averages (each pair's mean, each difference with
    itself too), and the interval between the order statistics that the exact signed-rank distribution
    for n untied differences puts at (1 - level) / 2 in each tail (coverage at least level)."""
    d = np.asarray(differences, float)
    n = len(d)
    walsh = np.sort([(d[i] + d[j]) / 2 for i in range(n) for j in range(i, n)])
    null = signed_rank_null(np.arange(1, n + 1, dtype=float))
    # k: how many sums t have P(sum of positive ranks <= t) <= (1 - level) / 2 (those 0..k-1); the
    # interval is [k-th smallest, k-th largest], covering 1 - 2 P(sum <= k - 1) >= level.
    cdf = np.cumsum(np.bincount(null.astype(int))) / len(null)
    k = int(np.searchsorted(cdf, (1 - level) / 2, side="right"))
    if k == 0:  # too few differences for the level: the whole range
        return float(np.median(walsh)), float(walsh[0]), float(walsh[-1])
    return float(np.median(walsh)), float(walsh[k - 1]), float(walsh[len(walsh) - k])


def arm_result(out: Path, seed: int, arm: str, args) -> dict | None:
    """An arm's figures on a seed, or None while it is not played: its pick's greedy return, its best
    and mean member by the final training mean, the pick, and how many times members exploited."""
    sweep_dir = out / arm / f"seed{seed}"
    scores = member_scores(sweep_dir, args.members, args.steps)
    greedy = played(out / "test" / arm / f"seed{seed}")
    if scores is None or greedy is None:
        return None
    member, row = population.best_member(sweep_dir / "pbt")
    exploits = sum(r["event"] == "exploit" for r in population.read_table(sweep_dir / "pbt"))
    train, mean = max(scores), float(np.mean(scores))
    return dict(greedy=greedy, train=train, mean=mean, member=member, score=row["score"], exploits=exploits)


def results_by_seed(out: Path, args) -> dict:
    """seed -> arm -> arm_result (None where that arm is not played)."""
    return {seed: {arm: arm_result(out, seed, arm, args) for arm in ARMS} for seed in args.seeds}


def summarise(results: dict, args) -> None:
    for seed, arms in results.items():
        line = [f"seed {seed}:"]
        for arm, r in arms.items():
            if r is None:
                line.append(f"{arm} unfinished")
                continue
            line.append(
                f"{arm}: picked member {r['member']} (last score {r['score']:.1f}), greedy {r['greedy']:7.1f}; "
                f"training mean-100 best {r['train']:.1f} mean {r['mean']:.1f}; exploits {r['exploits']}"
            )
        print("  ".join(line))
    both = [seed for seed, arms in results.items() if all(arms.values())]
    if not both:
        print("No seed finished in both arms yet.")
        return
    named = {"greedy": "picked member, greedy return", "train": "best member, training mean-100"}
    print(f"{len(both)} seed(s) finished in both arms; {named[args.measure]}, mean [95% t interval over seeds]:")
    for arm in ARMS:
        values = np.array([results[s][arm][args.measure] for s in both])
        low, high = t_interval(values)
        print(f"  {arm:5s} {values.mean():.1f} [{low:.1f}, {high:.1f}]")
    difference = np.array([results[s]["pbt"][args.measure] - results[s]["fixed"][args.measure] for s in both])
    low, high = t_interval(difference)
    wins, behind = int((difference > 0).sum()), int((difference < 0).sum())
    print(f"  pbt - fixed: {difference.mean():.1f} [{low:.1f}, {high:.1f}]; pbt ahead on {wins}, behind on {behind}")
    p, used = signed_rank_test(difference)
    estimate, low, high = hodges_lehmann(difference)
    print(
        f"  pbt - fixed, Wilcoxon signed-rank (exact, two-sided, {used} untied seeds): p = {p:.4f}; "
        f"Hodges-Lehmann estimate {estimate:.1f} [95%: {low:.1f}, {high:.1f}]"
    )


def run(argv: list[str]) -> None:
    print("$", " ".join(argv[1:]), flush=True)
    subprocess.run(argv, cwd=REPO, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="Acrobot-v1", help="env.id (Acrobot-v1: the first two tests)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100_000, help="agent steps per member")
    parser.add_argument("--interval", type=int, default=10_000, help="pbt.interval_steps")
    parser.add_argument("--episodes", type=int, default=20, help="greedy episodes the picked member plays")
    parser.add_argument("--measure", choices=("greedy", "train"), default="greedy", help="what the test compares")
    parser.add_argument("--launcher", default="submitit_local", help="hydra/launcher (basic: members in turn)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "reports" / "pbt" / "runs")
    parser.add_argument("--report", type=Path, default=REPO / "docs" / "reports" / "pbt")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    out = args.out.resolve()
    if not args.report_only:
        for seed in args.seeds:
            for arm in ARMS:
                test_dir = out / "test" / arm / f"seed{seed}"
                if played(test_dir) is not None:
                    thin(out / arm / f"seed{seed}", test_dir)  # done (thinned again: a no-op once thin)
                    continue  # a later run of the script skips it
                started = time.monotonic()
                sweep_dir = out / arm / f"seed{seed}"
                run(train_command(out, seed, arm, args))
                if member_scores(sweep_dir, args.members, args.steps) is None:
                    # A member that never started (submitit's local launcher loses one now and then under
                    # load): the arm once more; its finished members resume at their end and stop.
                    print(f"seed {seed}, {arm}: a member fell short; the arm again", flush=True)
                    run(train_command(out, seed, arm, args))
                if member_scores(sweep_dir, args.members, args.steps) is not None:  # else a member fell short
                    run(test_command(out, seed, arm, args))
                if played(test_dir) is not None:
                    thin(sweep_dir, test_dir)
                print(f"seed {seed}, {arm}: {time.monotonic() - started:.0f} s", flush=True)
    results = results_by_seed(out, args)
    if not (args.report_only or all(all(arms.values()) for arms in results.values())):
        print("Not every seed is played in both arms: the figures and the report wait (--report-only: now).")
        return
    summarise(results, args)
    sweeps = [out / arm / f"seed{seed}" for arm in ARMS for seed in args.seeds]
    sweeps = [sweep for sweep in sweeps if sweep.is_dir()]
    if sweeps:
        # Paths relative to the repository (where the report runs): its header names them, in git.
        named = [
            str(sweep.resolve().relative_to(REPO)) if sweep.resolve().is_relative_to(REPO) else str(sweep)
            for sweep in sweeps
        ]
        report = [sys.executable, "-m", "torchbeast_hydra.analysis.report", *named]
        subprocess.run([*report, "--metric", "train", "--out", str(args.report)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
