"""Learning: does the default command solve the task, on each backend, and how fast?

    python benchmarks/learning.py pong                  # env=pong on mono and poly, seed 1, 5M steps
    python benchmarks/learning.py pong --backends mono --seeds 1 2 3 --stop-at-target
    python benchmarks/learning.py cartpole              # experiment=cartpole, seeds 1 2 3, both backends
    python benchmarks/learning.py control               # experiment=control: InvertedPendulum-v5, 1M steps
    python benchmarks/learning.py half_cheetah          # experiment=control env.id=HalfCheetah-v5, 3M steps
    python benchmarks/learning.py minigrid              # env=minigrid (DoorKey-6x6) to 1M steps; doorkey8: 8x8
    python benchmarks/learning.py minihack              # env=minihack (Room-15x15) to 2M steps
    python benchmarks/learning.py nethack --backends poly   # env=nethack (NetHackScore-v0) to 5M steps
    python benchmarks/learning.py pong --from-runs outputs/2026-11-23/04-43-07 ...  # read runs, no training

Pong: the product's main command (`python -m torchbeast_hydra env=pong`, nothing else), stopped
after --max-steps agent steps (5M = 20M frames); target: mean return >= +18 over the last 100
whole games. CartPole: experiment=cartpole to its own total_steps; target 475. Control (needs
pip install ".[mujoco]"): experiment=control on InvertedPendulum-v5, target 950 within its 1M
steps; on HalfCheetah-v5 for 3M steps, against CleanRL's PPO at 1M steps (1,443 +- 46 on
HalfCheetah-v4, its docs/benchmark/ppo_continuous_action.md) as the target line. NetHack
(pip install ".[nethack]"): no goal at 5M steps; its dashed line is what NLE's authors print for
their baseline on NetHackScore (human monk, the env's default character): 971, the mean of the last
10k episodes after 1e9 steps over 3 runs (nle/agent/README.md; the paper's own is a plotted curve).

Writes into --out (default benchmarks/results/TASK-DATE): curve.png (mean return of the last 100
games against agent steps and against wall-clock hours, one line per backend and seed),
table.md and table.csv (steps and wall time to the target, final score, mean steps/s, machine),
and the runs themselves under runs/.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cli_command, platform_line  # noqa: E402

from torchbeast_hydra.logs.metrics import RECENT_EPISODES, RecentReturns, read_rows  # noqa: E402

WINDOW = RECENT_EPISODES  # games in the moving mean


@dataclass(frozen=True)
class Task:
    overrides: tuple  # the command's overrides, on top of backend= and seed=
    target: float
    max_steps: int | None  # stop the run here; None: its own total_steps
    seeds: tuple
    target_label: str = "target"  # the dashed line's name: a goal, or a published figure to read beside


TASKS = {
    "pong": Task(overrides=("env=pong",), target=18.0, max_steps=5_000_000, seeds=(1,)),
    "cartpole": Task(overrides=("experiment=cartpole",), target=475.0, max_steps=None, seeds=(1, 2, 3)),
    "control": Task(overrides=("experiment=control",), target=950.0, max_steps=None, seeds=(1, 2, 3)),
    # The env families' defaults (env=minigrid|minihack|nethack, nothing else), stopped at the
    # issue's step budgets. NetHack's line is no goal for 5M steps: it is the number NLE's authors
    # print for their baseline (human monk, the env's default), at 1e9 steps.
    "minigrid": Task(overrides=("env=minigrid",), target=0.9, max_steps=1_000_000, seeds=(1,)),
    "doorkey8": Task(
        overrides=("env=minigrid", "env.id=MiniGrid-DoorKey-8x8-v0"), target=0.9, max_steps=1_000_000, seeds=(1,)
    ),
    "minihack": Task(overrides=("env=minihack",), target=0.8, max_steps=2_000_000, seeds=(1,)),
    "nethack": Task(
        overrides=("env=nethack",),
        target=971.0,
        max_steps=5_000_000,
        seeds=(1,),
        target_label="NLE's baseline after 1e9 steps (nle/agent/README.md)",
    ),
    "half_cheetah": Task(
        overrides=("experiment=control", "env.id=HalfCheetah-v5", "total_steps=3000000"),
        target=1443.0,
        max_steps=None,
        seeds=(1, 2, 3),
        target_label="CleanRL's PPO at 1M steps",
    ),
}


def moving_mean(rows: list, window: int = WINDOW, min_games: int = 10) -> list:
    """(step, hours, mean of the last `window` games) after each update that ended a game."""
    recent, points = RecentReturns(window), []
    for row in rows:
        if row["episode_returns"]:
            recent.extend(row["episode_returns"])
            if len(recent) >= min_games:
                points.append((row["step"], row["time_s"] / 3600, recent.mean))
    return points


def summarise(rows: list, target: float) -> dict:
    """Steps and seconds to the target (full window only), final and best means, mean steps/s."""
    recent = RecentReturns()
    best, reached = float("-inf"), None
    for row in rows:
        recent.extend(row["episode_returns"])
        if recent.full:
            mean = recent.mean
            best = max(best, mean)
            if reached is None and mean >= target:
                reached = (row["step"], row["time_s"])
    last = rows[-1]
    return dict(
        steps_to_target=reached[0] if reached else None,
        minutes_to_target=round(reached[1] / 60, 1) if reached else None,
        final_mean=round(recent.mean, 2) if len(recent) else None,
        best_mean=round(best, 2) if recent.full else None,
        games=sum(len(row["episode_returns"]) for row in rows),
        steps=last["step"],
        hours=round(last["time_s"] / 3600, 2),
        mean_sps=round(last["step"] / last["time_s"]) if last["time_s"] else None,
    )


def last_step(run_dir: Path) -> int:
    """The step of logs.csv's last complete row (0 before the first)."""
    try:
        rows = read_rows(run_dir)
    except (OSError, ValueError):
        return 0
    return rows[-1]["step"] if rows else 0


def train(run_dir: Path, overrides: list, max_steps: int | None, stop_early) -> int:
    """Runs the CLI in run_dir (resuming if it holds a checkpoint); SIGTERM once max_steps is
    reached or stop_early(rows) says so (the run checkpoints and exits cleanly)."""
    command = cli_command(run_dir, overrides)  # wandb off, as in every benchmark
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "benchmark.out", "a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            while process.poll() is None:
                time.sleep(10)
                if (max_steps and last_step(run_dir) >= max_steps) or stop_early(run_dir):
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=300)
        finally:
            if process.poll() is None:
                process.kill()
    return process.returncode


def label_of(run_dir: Path) -> str:
    """backend and seed, from the run's saved config."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    return f"{cfg.backend.name} seed {cfg.seed}"


def plot(curves: dict, target: float, target_label: str, path: Path, title: str) -> None:
    fig = Figure(figsize=(12, 4.2), dpi=100, layout="constrained")
    by_steps, by_time = fig.subplots(1, 2)
    for i, (label, points) in enumerate(curves.items()):
        if not points:
            continue
        steps, hours, means = zip(*points)
        by_steps.plot([s / 1e6 for s in steps], means, color=f"C{i}", label=label)
        by_time.plot(hours, means, color=f"C{i}", label=label)
    highest = max((mean for points in curves.values() for *_, mean in points), default=target)
    for ax, xlabel in ((by_steps, "agent steps (millions; Atari: x4 = frames)"), (by_time, "wall-clock hours")):
        if target <= 2 * abs(highest):
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"{target_label}: {target:g}")
        elif ax is by_steps:  # far above (NetHack at 5M vs 1e9 steps): a line would flatten the curves
            ax.plot([], [], " ", label=f"{target_label}: {target:g} (above the scale)")  # a legend entry only
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"mean return, last {WINDOW} games")
        ax.grid(alpha=0.3)
    # One legend under both panels: inside either it would hide the curves.
    fig.legend(*by_steps.get_legend_handles_labels(), loc="outside lower center", ncols=min(4, len(curves) + 1))
    fig.suptitle(title)
    fig.savefig(path)


def write_tables(results: dict, out: Path, machine: str, command: str) -> str:
    fields = ["run", *next(iter(results.values()))]
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows({"run": label, **summary} for label, summary in results.items())
    lines = [
        f"machine: {machine}",
        f"command: `{command}`",
        "",
        "| " + " | ".join(fields) + " |",
        "|" + "---|" * len(fields),
    ]
    for label, summary in results.items():
        lines.append("| " + " | ".join(str(v if v is not None else "-") for v in [label, *summary.values()]) + " |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--backends", nargs="+", default=["mono", "poly"], choices=["mono", "poly"])
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--max-steps", type=int, help="stop each run here (pong: 5M)")
    parser.add_argument("--stop-at-target", action="store_true", help="stop a run once it reaches the target")
    parser.add_argument("--from-runs", type=Path, nargs="+", help="read these run dirs instead of training")
    parser.add_argument("--labels", nargs="+", help="with --from-runs: one label a run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (the figures then are not the defaults')")
    args = parser.parse_intermixed_args()
    task = TASKS[args.task]
    max_steps = args.max_steps or task.max_steps
    out = args.out or Path(__file__).parent / "results" / f"{args.task}-{datetime.date.today()}"
    out.mkdir(parents=True, exist_ok=True)
    machine = platform_line()
    command = "python -m torchbeast_hydra " + " ".join([*task.overrides, *args.overrides])

    def reached(run_dir: Path) -> bool:
        if not args.stop_at_target:
            return False
        try:
            return summarise(read_rows(run_dir), task.target)["steps_to_target"] is not None
        except (OSError, ValueError, IndexError):
            return False

    run_dirs = list(args.from_runs or [])
    if not run_dirs:
        for backend in args.backends:
            for seed in args.seeds or task.seeds:
                run_dir = out / "runs" / f"{backend}-seed{seed}"
                overrides = [*task.overrides, f"backend={backend}", f"seed={seed}", *args.overrides]
                started = time.monotonic()
                rc = train(run_dir, overrides, max_steps, reached)
                print(f"{backend} seed {seed}: exit {rc} after {(time.monotonic() - started) / 60:.0f} min", flush=True)
                run_dirs.append(run_dir)

    curves, results = {}, {}
    labels = args.labels or [None] * len(run_dirs)
    if len(labels) != len(run_dirs):
        parser.error(f"--labels takes one label for each of the {len(run_dirs)} runs")
    for run_dir, label in zip(run_dirs, labels):
        label = label or label_of(run_dir)
        if label in results:  # two runs of one backend and seed (e.g. before and after a change)
            label = f"{label} ({run_dir.name})"
        rows = [row for row in read_rows(run_dir) if not max_steps or row["step"] <= max_steps]
        curves[label] = moving_mean(rows)
        results[label] = summarise(rows, task.target)
    plot(curves, task.target, task.target_label, out / "curve.png", f"{command}  ({machine})")
    print(write_tables(results, out, machine, command))
    print(f"wrote {out / 'curve.png'}, {out / 'table.md'}, {out / 'table.csv'}")


if __name__ == "__main__":
    main()
