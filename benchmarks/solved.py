"""Does every run reach its task's solved level, and stay there? The laptop suite's bar (issue 48).

    python benchmarks/solved.py docs/reports/suite-classic/runs                 # CartPole-v1 475, Acrobot-v1 -100
    python benchmarks/solved.py SWEEP_DIR --level LunarLander-v3=200 --keep 0.9

Reads each run's evaluations (eval.csv) and its task (the env id of its saved config) with the
report's loader, and prints, per run, its evaluation returns, the step of the first at or past the
level, the lowest after it and PASS or FAIL; then, per task, how many runs passed. A run passes when
an evaluation reaches the level and none after it falls below the floor: `keep` of a positive level
(0.9 x 475 = 427.5); a negative level is a cost, so its floor is the level over `keep` (-100 / 0.9 =
-111.1: the level is 0.9 of the floor's cost, as 427.5 is 0.9 of 475).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from torchbeast_hydra.analysis import runs
from torchbeast_hydra.analysis.baselines import load_baselines


def solved_levels() -> dict:
    """{task: its solved level}: baselines.yaml's `solved` references (gymnasium's reward_threshold)."""
    return {
        task: float(reference["score"])
        for task, baseline in load_baselines().items()
        for reference in baseline.references
        if reference["name"] == "solved"
    }


def floor(level: float, keep: float) -> float:
    return keep * level if level >= 0 else level / keep


@dataclass
class Verdict:
    run: str
    task: str
    returns: list  # (step, evaluation return), by step
    solved_at: Optional[int]  # the step of the first evaluation at or past the level
    lowest_after: Optional[float]  # the lowest evaluation after that one
    passed: bool


def judge(run: runs.Run, level: float, keep: float) -> Verdict:
    evals = [] if run.evals is None else list(zip(run.evals["step"].astype(int), run.evals["mean_return"]))
    first = next((i for i, (_, score) in enumerate(evals) if score >= level), None)
    after = [score for _, score in evals[first + 1 :]] if first is not None else []
    lowest = min(after) if after else None
    passed = first is not None and (lowest is None or lowest >= floor(level, keep))
    return Verdict(run.name, run.task, evals, evals[first][0] if first is not None else None, lowest, passed)


def verdicts(paths: list, levels: dict, keep: float) -> list[Verdict]:
    """A verdict for each run of a task with a level; runs of other tasks are left out."""
    loaded = [run for run in runs.load(paths) if run.task in levels]
    return [judge(run, levels[run.task], keep) for run in sorted(loaded, key=lambda r: runs.natural_key(r.name))]


def parse_level(text: str) -> tuple[str, float]:
    task, sep, value = text.rpartition("=")
    try:
        return task, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--level {text}: expected TASK=X with a number X") from None


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run dirs, sweep dirs or a report's runs/")
    parser.add_argument(
        "--level",
        type=parse_level,
        action="append",
        help="TASK=X: a task's solved level (default: baselines.yaml's solved)",
    )
    parser.add_argument("--keep", type=float, default=0.9, help="the floor after solving, as a fraction of the level")
    args = parser.parse_args(argv)
    levels = dict(args.level) if args.level else solved_levels()
    found = verdicts(args.paths, levels, args.keep)
    for v in found:
        scores = " ".join(f"{score:.1f}" for _, score in v.returns)
        solved = f"solved at {v.solved_at:,}" if v.solved_at is not None else "never solved"
        lowest = f"lowest after {v.lowest_after:.1f}" if v.lowest_after is not None else "no evaluation after"
        print(f"{'PASS' if v.passed else 'FAIL'}  {v.run}: {scores} | {solved} | {lowest}")
    for task in sorted({v.task for v in found}):
        mine = [v for v in found if v.task == task]
        level = levels[task]
        print(
            f"{task}: {sum(v.passed for v in mine)}/{len(mine)} runs reach {level:g} and stay at or above "
            f"{floor(level, args.keep):.1f}"
        )


if __name__ == "__main__":
    main()
