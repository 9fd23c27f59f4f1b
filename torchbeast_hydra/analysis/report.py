"""`python -m torchbeast_hydra.analysis.report PATH... [--out DIR] [--target X] [--metric auto|eval|train]`

A report on runs and sweeps (run dirs and/or multirun dirs, several compared together):

- per task (env.id): a curve PNG, the return against agent steps, per setting the mean over seeds
  with a 95% bootstrap band and each seed as a thin line, published references dashed;
- report.md: per task a table (seeds, final and best score with 95% intervals over seeds, steps to a
  target, training time, steps/s); across tasks, IQM / median / mean / optimality gap of the final
  scores normalised by each task's random and reference score (baselines.yaml beside this file,
  which says where each number was read), with stratified bootstrap 95% intervals (scores.py);
- performance_profile.png, and tasks.csv / aggregates.csv with the same numbers as the tables.

The score is the evaluation return (eval.csv's mean_return against step) when every run has one,
else the training return (the mean of the last --window episodes at each logs.csv row); --metric
picks one. A setting is what differs between a task's runs other than the seed and the keys that
only say how a run logs, where it writes or when it stops (sweep_record.RUN_CONTROL_KEYS): seeds of
one setting are aggregated.

This module is the command and its order of work; the parts: runs.py (the one loader), tables.py
(scores, tables, intervals), figures.py, markdown.py (report.md), baselines.py (references).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
from matplotlib.figure import Figure

from torchbeast_hydra.analysis import baselines, figures, formatting, markdown, populations, runs, scores, tables
from torchbeast_hydra.analysis.baselines import BASELINES


@dataclass
class Options:
    metric: str = "auto"
    targets: dict = field(default_factory=dict)  # task -> target; "" -> every task's
    window: int = 100
    reps: int = scores.DEFAULT_REPS
    seed: int = 0
    baselines: Path = BASELINES
    keep_runs: bool = False  # copy what the report reads of each run to OUT/runs (runs.copy_run)

    def target(self, task: str) -> Optional[float]:
        """The task's target: its own, else every task's (--target X), else None."""
        return self.targets.get(task, self.targets.get(""))


def write_report(paths: Sequence[str | Path], out_dir: str | Path, options: Optional[Options] = None) -> dict:
    """Reads the runs under paths and writes the report to out_dir; returns {name: path}."""
    options = options or Options()
    loaded = runs.load(paths, options.window)
    metric = tables.pick_metric(loaded, options.metric)
    # A job of a sweep still starting (or one that died at start) has no score yet: named, not drawn.
    missing = [r.name for r in loaded if not len(tables.curve(r, metric)[0])]
    loaded = [r for r in loaded if r.name not in missing]
    if not loaded:
        raise FileNotFoundError(
            f"no run has {tables.NO_SCORE[metric]}" + (": use --metric train" if metric == "eval" else "")
        )
    known = baselines.load_baselines(options.baselines)
    per_run = pd.DataFrame(
        [tables.summarise(r, metric, options.target(r.task), *_peer(known.get(r.task), r)) for r in loaded]
    )
    table = tables.task_table(per_run, options.reps, options.seed)
    normalised, used, left_out = tables.normalised_scores(per_run, known)
    aggregates = tables.aggregate_table(normalised, options.reps, options.seed)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    if options.keep_runs:
        written["runs"] = runs.keep_runs(loaded, out_dir / runs.KEPT_RUNS)
        if not baselines.is_packaged(options.baselines):  # kept, to draw it again
            written["baselines"] = out_dir / baselines.KEPT_BASELINES
            if written["baselines"].resolve() != Path(options.baselines).resolve():
                shutil.copyfile(options.baselines, written["baselines"])
    for task in runs.task_names(loaded):
        task_runs = [r for r in loaded if r.task == task]
        fig = figures.curve_figure(task, task_runs, metric, known.get(task), options.reps, options.seed)
        written[f"curve:{task}"] = _save(fig, out_dir / f"curve_{_file_name(task)}.png")
    population_sections = []
    for population_dir in sorted({p for path in paths for p in populations.find_populations(Path(path))}):
        name = _population_name(population_dir, paths)
        fig, summary = populations.population_figure(population_dir, name, options.window)
        written[f"population:{name}"] = _save(fig, out_dir / f"population_{_file_name(name)}.png")
        population_sections += populations.markdown(name, written[f"population:{name}"].name, summary)
    written["profile"] = _save(
        figures.profile_figure(normalised, options.reps, options.seed), out_dir / "performance_profile.png"
    )
    written["tasks_csv"] = out_dir / "tasks.csv"
    table.to_csv(written["tasks_csv"], index=False)
    written["runs_csv"] = out_dir / "runs.csv"  # each run's figures: our evaluation and the peers' measure
    per_run.to_csv(written["runs_csv"], index=False)
    written["aggregates_csv"] = out_dir / "aggregates.csv"
    aggregates.to_csv(written["aggregates_csv"], index=False)
    short = per_run[per_run["unfinished"]].itertuples(index=False)
    unfinished = [f"{r.run} at {formatting.steps(r.steps)} of {formatting.steps(r.total_steps)}" for r in short]
    scored = tables.Scored(loaded, metric, missing, per_run, table, aggregates, used, left_out, known, unfinished)
    text = markdown.render_markdown(paths, scored, options, written)
    if population_sections:
        text += "\n## Populations (population-based training)\n" + "\n".join(population_sections) + "\n"
    written["report"] = out_dir / "report.md"
    written["report"].write_text(text)
    return written


def _population_name(population_dir: Path, paths: Sequence) -> str:
    """A population's name in the report: its dir relative to what the paths have in common (with one
    path, its parent), so that the same layout under two paths (runs/pbt/seed1/pbt and
    runs/fixed/seed1/pbt) gives two names, and two figures."""
    roots = [Path(path).resolve() for path in paths]
    base = Path(os.path.commonpath(roots))
    if base in roots:  # one path, or one inside another: keep that path's own name
        base = base.parent
    found = population_dir.resolve()
    return str(found.relative_to(base)) if found.is_relative_to(base) else str(population_dir)


def _peer(baseline: Optional[baselines.Baseline], run: runs.Run) -> tuple:
    """(budget, reference): a run's peer figure is read on its task's peer reference's measure, at
    that reference's budget when the run was meant to reach it (its total_steps), else at its own
    total_steps (and then not compared)."""
    reference = baseline.peer_reference() if baseline is not None else None
    total_steps = run.config.get("total_steps")
    if reference is None or (isinstance(total_steps, (int, float)) and total_steps < reference["steps"]):
        return total_steps, reference
    return float(reference["steps"]), reference


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path


def _file_name(task: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", task)


# The command.


def parse_targets(values: Sequence[str]) -> dict:
    """`18` (every task) and/or `ALE/Pong-v5=18` (one task) -> {task or "": target}."""
    targets = {}
    for value in values:
        task, _, number = value.rpartition("=")
        try:
            targets[task] = float(number)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--target {value}: expected X or TASK=X with a number X") from None
    return targets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchbeast_hydra.analysis.report",
        description="Per-task curves and tables, and scores across tasks normalised by published references "
        "(IQM, median, mean, optimality gap with stratified bootstrap intervals; a performance profile), "
        "for run dirs and sweeps.",
    )
    parser.add_argument(
        "paths", nargs="*", metavar="PATH", help="run dirs and/or multirun dirs (default: the newest under outputs/)"
    )
    parser.add_argument(
        "--out", help="where to write report.md and the PNGs (default: PATH/report, or the paths' common parent's)"
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="[TASK=]X",
        help="the score whose first crossing the table gives in steps; TASK=X for one task (repeatable)",
    )
    parser.add_argument(
        "--metric",
        choices=["auto", "eval", "train"],
        default="auto",
        help="eval: eval.csv's mean return; train: the training return; auto (default): eval if every run has one",
    )
    parser.add_argument(
        "--window", type=int, default=100, help="training return: the mean of the last N episodes (default 100)"
    )
    parser.add_argument("--reps", type=int, default=scores.DEFAULT_REPS, help="bootstrap replicates (default 2,000)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    parser.add_argument(
        "--baselines",
        type=Path,
        default=baselines.BASELINES,
        help="the reference scores (default: the packaged baselines.yaml)",
    )
    parser.add_argument(
        "--keep-runs",
        action="store_true",
        help="copy what the report reads of each run (config, evaluations, logs.csv's returns) to OUT/runs, "
        "so that it can be drawn again from there (e.g. for a report kept under version control)",
    )
    args = parser.parse_args(argv)

    try:
        targets = parse_targets(args.target)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    try:
        paths = [Path(p) for p in args.paths] or [runs.latest_runs_dir()]
        out_dir = Path(args.out) if args.out else _default_out(paths)
        options = Options(args.metric, targets, args.window, args.reps, args.seed, args.baselines, args.keep_runs)
        written = write_report(paths, out_dir, options)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(written["report"].read_text())
    for path in written.values():
        print(f"wrote {path}")
    return 0


def _default_out(paths: list) -> Path:
    base = paths[0] if len(paths) == 1 else Path(os.path.commonpath([p.resolve() for p in paths]))
    return base / "report"


if __name__ == "__main__":
    sys.exit(main())
