"""Learning: does the default command solve the task, on each backend, and how fast?

Each task is a benchmark suite, run as one Hydra multirun (backends x seeds, any launcher, each job
resumable in its dir) and read back by the report command (torchbeast_hydra/analysis/report.py):

    python benchmarks/learning.py cartpole                     # experiment=cartpole, seeds 1 2 3, mono and poly
    python benchmarks/learning.py pong --backends mono --seeds 1 2 3 4 5
    python benchmarks/learning.py control --launcher submitit_local      # jobs in parallel
    python benchmarks/learning.py mujoco --backends mono                 # 4 MuJoCo tasks x 3 seeds
    python benchmarks/learning.py doorkey8 --launcher slurm              # one SLURM job each
    python benchmarks/learning.py pong --from-runs SWEEP_OR_RUN_DIR...   # the report only, no training

It prints the multirun command it launches, so the sweep can be resumed (the same command again) or
extended by hand, then writes the report (per-task curves with bootstrap bands, tables with steps
to the task's target, aggregate scores normalised by the published baselines of
torchbeast_hydra/analysis/baselines.yaml) into SWEEP_DIR/report.

Targets: Pong +18 (mean over the last 100 whole games; evaluation return where the runs evaluate),
CartPole 475, InvertedPendulum 950, MuJoCo CleanRL's PPO at 1M steps (HalfCheetah 1,443, Hopper
2,383, Walker2d 2,288; Ant has no reference at 1M), DoorKey 0.9, MiniHack Room-15x15 0.8 and
Room-Monster-15x15 0.9, NetHack NLE's baseline after 1e9 steps (971; no goal for 5M steps).
A task with a step budget runs with total_steps at the budget (the learning rate anneals over it).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from torchbeast_hydra.analysis import report


@dataclass(frozen=True)
class Task:
    overrides: tuple  # the command's overrides, on top of backend= and seed=
    target: float | dict  # the report's steps-to-target: one for every task, or {env id: target}
    seeds: tuple = (1,)

    @property
    def targets(self) -> dict:
        """report.Options.targets: task -> target ("": every task's)."""
        return dict(self.target) if isinstance(self.target, dict) else {"": self.target}


TASKS = {
    "pong": Task(("env=pong",), target=18.0),
    "cartpole": Task(("experiment=cartpole",), target=475.0, seeds=(1, 2, 3)),
    "control": Task(("experiment=control",), target=950.0, seeds=(1, 2, 3)),
    "half_cheetah": Task(("experiment=control", "env.id=HalfCheetah-v5", "total_steps=3000000"), 1443.0, (1, 2, 3)),
    "mujoco": Task(
        ("experiment=control", "env.id=HalfCheetah-v5,Hopper-v5,Walker2d-v5,Ant-v5"),
        target={"HalfCheetah-v5": 1443.0, "Hopper-v5": 2383.0, "Walker2d-v5": 2288.0},
        seeds=(1, 2, 3),
    ),
    "minigrid": Task(("env=minigrid", "total_steps=1000000", "eval.interval_steps=50000"), target=0.9),
    "doorkey8": Task(("experiment=minigrid",), target=0.9, seeds=(1, 2, 3)),  # DoorKey-8x8, APPO, 2M steps
    "minihack": Task(("env=minihack", "total_steps=2000000", "eval.interval_steps=100000"), target=0.8),
    "minihack_monster": Task(("experiment=minihack",), target=0.9, seeds=(1, 2, 3)),  # Room-Monster-15x15, APPO
    "nethack": Task(("env=nethack", "total_steps=5000000"), target=971.0),
}


def multirun_command(task: Task, backends: list, seeds: list, sweep_dir: Path, launcher: str, extra: list) -> list:
    """The Hydra multirun that runs the task's suite."""
    return [
        sys.executable,
        "-m",
        "torchbeast_hydra",
        "-m",
        *task.overrides,
        f"backend={','.join(backends)}",
        f"seed={','.join(map(str, seeds))}",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra/launcher={launcher}",
        *extra,
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--backends", nargs="+", default=["mono", "poly"], choices=["mono", "poly"])
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--launcher", default="basic", help="hydra/launcher=...: basic, submitit_local, slurm")
    parser.add_argument("--sweep-dir", type=Path, help="default: benchmarks/results/TASK-DATE (resumes if there)")
    parser.add_argument("--from-runs", type=Path, nargs="+", help="report on these run or sweep dirs; no training")
    parser.add_argument("--out", type=Path, help="the report's dir (default: SWEEP_DIR/report)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (the figures then are not the defaults')")
    args = parser.parse_intermixed_args(argv)
    task = TASKS[args.task]
    paths = list(args.from_runs or [])
    if not paths:
        sweep_dir = args.sweep_dir or Path(__file__).parent / "results" / f"{args.task}-{datetime.date.today()}"
        command = multirun_command(
            task, args.backends, args.seeds or task.seeds, sweep_dir, args.launcher, args.overrides
        )
        print(" ".join(command[1:]), flush=True)
        subprocess.run(command, check=False)  # a failed or stopped job: the report shows what there is
        paths = [sweep_dir]
    out = args.out or paths[0] / "report"
    written = report.write_report(paths, out, report.Options(targets=task.targets))
    print(written["report"].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
