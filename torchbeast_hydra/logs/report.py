"""`python -m torchbeast_hydra.logs.report PATH... [--out DIR] [--target X] [--metric auto|eval|train]`

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
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure

from torchbeast_hydra.logs import measures, population_figures, runs, scores
from torchbeast_hydra.logs.metrics import target_met
from torchbeast_hydra.logs.sweep_record import is_run_control

BASELINES = Path(__file__).with_name("baselines.yaml")
NO_SCORE = {"eval": "evaluation yet", "train": "finished episode yet"}  # what a run without a score lacks
DPI = 100
ALL_RUNS = runs.ALL_RUNS

# The task is the env id; the env option (and what it brings) is the same within a task.
TASK_KEYS = ("env", "env.id")


@dataclass
class Run:
    dir: Path
    name: str
    task: str
    seed: Optional[int]
    config: dict
    train: pd.DataFrame  # runs.load_run: logs.csv rows with recent_return
    evals: Optional[pd.DataFrame]  # runs.load_eval: eval.csv rows, or None
    setting: str = ALL_RUNS
    tests: list = field(default_factory=list)  # mode=test dirs that played it (evals has theirs)


@dataclass
class Baseline:
    """One task's entry of baselines.yaml."""

    task: str
    random: Optional[dict] = None
    references: list = field(default_factory=list)
    normalise_by: Optional[str] = None
    same_dynamics: list = field(default_factory=list)  # ids whose figures compare with each other
    notes: Optional[str] = None

    def why_not_comparable(self, reference: dict, task: str) -> Optional[str]:
        """None if runs on task compare with this reference (measures.why_not_comparable)."""
        return measures.why_not_comparable(reference, task, self.same_dynamics)

    def peer_budget(self) -> Optional[float]:
        """The steps at which the peers' measure (train_last_100) is read for this task: its
        normaliser's, else its first such reference's; None if it has none."""
        peers = [r for r in self.references if measures.measure_of(r) == "train_last_100" and r.get("steps")]
        peers.sort(key=lambda r: r["name"] != self.normalise_by)
        return float(peers[0]["steps"]) if peers else None

    def normaliser(self) -> Optional[dict]:
        """The reference that scores 1 (with the random score as 0), or None if either is missing."""
        if self.random is None or self.normalise_by is None:
            return None
        return next((r for r in self.references if r["name"] == self.normalise_by), None)


# Reading.


def load_runs(paths: Sequence[str | Path], window: int = 100) -> list:
    """Every run at or under paths, named as runs.load_runs names them, with its task and setting."""
    paths = [Path(p) for p in paths]
    found, tested = {}, {}
    for path in paths:
        dirs = runs.find_runs(path)
        tested.update(runs.find_tested(path))  # mode=test's evaluations, of runs here or elsewhere
        if not dirs and not tested:
            raise FileNotFoundError(f"no runs (no logs.csv) under {path}")
        found.update({d.resolve(): d for d in dirs})  # a run given twice counts once
    found.update({trained: trained for trained in tested if trained not in found})
    base = paths[0].resolve() if len(paths) == 1 else Path(os.path.commonpath([p.resolve() for p in paths]))
    loaded = []
    for resolved in found:
        name = (
            resolved.name
            if resolved == base
            else str(resolved.relative_to(base) if resolved.is_relative_to(base) else resolved)
        )
        config = {**runs.read_overrides(resolved), **runs.read_config(resolved)}
        loaded.append(
            Run(
                dir=resolved,
                name=name,
                task=str(config.get("env.id") or config.get("env") or "unknown task"),
                seed=runs.read_seed(resolved),
                config=config,
                train=runs.load_run(resolved, name=name, window=window),
                evals=_evaluations(resolved, tested.get(resolved, [])),
                tests=tested.get(resolved, []),
            )
        )
    assign_settings(loaded)
    return loaded


def _evaluations(run_dir: Path, test_dirs: list) -> Optional[pd.DataFrame]:
    """A run's evaluations: during training (its eval.csv) and by mode=test (theirs), by step."""
    frames = [df for df in (runs.load_eval(d) for d in [run_dir, *test_dirs]) if df is not None]
    if not frames:
        return None
    return pd.concat(frames, ignore_index=True).sort_values("step", kind="stable").reset_index(drop=True)


def assign_settings(loaded: list) -> None:
    """Per task, the keys whose values differ between its runs (less the seed, the task's own keys
    and sweep_record.RUN_CONTROL_KEYS) label each run's setting, e.g. `optim.learning_rate=0.001`."""
    for task in tasks(loaded):
        group = [r for r in loaded if r.task == task]
        typed = {k for r in group for k in runs.read_overrides(r.dir)}
        configs = [{**r.config, runs.SEED: r.seed} for r in group]
        keys = [
            k
            for k in runs.differing_keys(configs, typed=typed)
            if k != runs.SEED and k not in TASK_KEYS and not is_run_control(k) and k not in POPULATION_KEYS
        ]
        for run in group:
            label = ",".join(f"{k}={run.config[k]}" for k in keys if run.config.get(k) is not None)
            run.setting = label or ALL_RUNS


# A population's members are one setting, as seeds are: their curves pool (pbt/, population_figures.py).
POPULATION_KEYS = ("pbt.member",)


def tasks(loaded: list) -> list:
    return sorted({r.task for r in loaded}, key=runs._natural_key)


def settings(loaded: list) -> list:
    return sorted({r.setting for r in loaded}, key=runs._natural_key)


def load_baselines(path: str | Path = BASELINES) -> dict:
    """{task id or alias: Baseline} from baselines.yaml."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    out = {}
    for task, entry in data.items():
        baseline = Baseline(
            task=task,
            random=entry.get("random"),
            references=list(entry.get("references") or []),
            normalise_by=entry.get("normalise_by"),
            same_dynamics=list(entry.get("same_dynamics") or []),
            notes=entry.get("notes"),
        )
        for reference in baseline.references:
            measures.measure_of(reference)  # an unknown measure fails here, naming the reference
        for name in [task, *(entry.get("aliases") or [])]:
            out[name] = baseline
    return out


# One run's numbers.


def pick_metric(loaded: list, metric: str) -> str:
    """auto: eval when every run has evaluations (mixing the two would compare unlike numbers)."""
    if metric != "auto":
        return metric
    return "eval" if all(r.evals is not None for r in loaded) else "train"


def curve(run: Run, metric: str) -> tuple:
    """(steps, scores): eval.csv's mean_return (pooled per step), or the training return."""
    if metric == "eval":
        if run.evals is None:
            return np.array([]), np.array([])
        per_step = pooled_by_step(run.evals)
        return per_step.index.to_numpy(float), per_step.to_numpy(float)
    rows = run.train.dropna(subset=[runs.RETURN])
    return rows["step"].to_numpy(float), rows[runs.RETURN].to_numpy(float)


def pooled_by_step(evals: pd.DataFrame) -> pd.Series:
    """Evaluations taken at the same step (the last periodic one and mode=test's, say) as one: the
    mean return over all their episodes, so 100 test episodes outweigh a 10-episode check."""
    episodes = evals["episodes"] if "episodes" in evals else pd.Series(1, index=evals.index)
    weights = pd.to_numeric(episodes, errors="coerce").fillna(1).clip(lower=1)
    returns = pd.to_numeric(evals["mean_return"], errors="coerce")
    totals = (returns * weights).groupby(evals["step"]).sum()
    return (totals / weights.groupby(evals["step"]).sum()).sort_index()


def met_stop_target(run: Run) -> bool:
    """Whether the run ended complete on evaluations that met its eval.stop_at_return."""
    stop_at = run.config.get("eval.stop_at_return")
    own = runs.load_eval(run.dir) if stop_at is not None else None  # not mode=test's evaluations
    if own is None:
        return False
    # The periodic evaluations: not the final one, nor rows mode=test added (no `final`).
    periodic = own[own["final"].eq(False)] if "final" in own else own
    confirmations = run.config.get("eval.stop_confirmations", 0)  # runs from before the option: none
    return target_met(zip(periodic["step"], periodic["mean_return"]), stop_at, confirmations) is not None


def summarise(run: Run, metric: str, target: Optional[float], budget: Optional[float] = None) -> dict:
    """Final and best score, the first step at or above target, training time and steps/s; the
    peers' measure (the mean of the last 100 training episodes) at budget (default: the run's
    total_steps); with evaluations, how many were pooled into the final score."""
    steps, values = curve(run, metric)
    total_steps = run.config.get("total_steps")
    budget = budget if budget is not None else total_steps
    peer = measures.last_episodes_mean(run.train, budget) if budget else None
    wall = float(run.train["time_s"].max()) if "time_s" in run.train and run.train["time_s"].notna().any() else np.nan
    last_step = float(run.train["step"].max())
    reached = np.nonzero(values >= target)[0] if target is not None and len(values) else []
    pooled, episodes = _final_pool(run) if metric == "eval" else (0, 0)
    return dict(
        run=run.name,
        task=run.task,
        setting=run.setting,
        seed=run.seed,
        # Short of its total_steps (still running, or stopped): its last score stands in for the final one.
        unfinished=isinstance(total_steps, int) and last_step < total_steps and not met_stop_target(run),
        total_steps=total_steps,
        final=float(values[-1]) if len(values) else np.nan,
        best=float(values.max()) if len(values) else np.nan,
        steps_to_target=float(steps[reached[0]]) if len(reached) else np.nan,
        peer=peer.value if peer else np.nan,
        peer_step=peer.step if peer else np.nan,
        peer_episodes=peer.episodes if peer else 0,
        peer_budget=budget if budget else np.nan,
        final_pooled=pooled,
        final_episodes=episodes,
        steps=last_step,
        wall_s=wall,
        sps=last_step / wall if wall and wall > 0 else np.nan,
    )


def _final_pool(run: Run) -> tuple[int, int]:
    """(evaluations, episodes) at the final evaluation's step: more than one evaluation there (the
    last periodic one and mode=test's, say) are pooled into the final score."""
    if run.evals is None or not len(run.evals):
        return 0, 0
    last = run.evals[run.evals["step"] == run.evals["step"].max()]
    episodes = pd.to_numeric(last["episodes"], errors="coerce").fillna(1) if "episodes" in last else None
    return len(last), int(episodes.sum()) if episodes is not None else len(last)


# Tables.


def task_table(per_run: pd.DataFrame, reps: int, seed: int, confidence: float = scores.CONFIDENCE) -> pd.DataFrame:
    """Per task and setting: seeds, final and best score and the peers' measure (the mean over
    seeds, with a bootstrap interval from measures.MIN_SEEDS_FOR_INTERVAL seeds, else the seeds'
    range: `spread` says which), steps to target (median over the seeds that reached it, how many
    did, and the best the others reached), training time and steps/s (means over seeds)."""
    rows = []
    for (task, setting), part in per_run.groupby(["task", "setting"], sort=False):
        row = dict(task=task, setting=setting, seeds=len(part), unfinished=int(part["unfinished"].sum()))
        for column in ("final", "best", "peer"):
            figure = measures.spread(part[column].to_numpy(float), reps, seed, confidence)
            row.update({column: figure.point, f"{column}_low": figure.low, f"{column}_high": figure.high})
            row["spread"] = row.get("spread") or figure.kind
        row["peer_seeds"] = int(part["peer"].notna().sum())
        row["peer_budget"] = float(part["peer_budget"].max())
        reached = part["steps_to_target"].dropna()
        others = part[part["steps_to_target"].isna()]["best"].dropna()
        row.update(
            reached=len(reached),
            steps_to_target=float(reached.median()) if len(reached) else np.nan,
            others_best=";".join(_number(v) for v in sorted(others)),  # what the seeds short of it reached
            wall_s=float(part["wall_s"].mean()),
            sps=float(part["sps"].mean()),
        )
        rows.append(row)
    rows.sort(key=lambda r: (runs._natural_key(r["task"]), runs._natural_key(r["setting"])))
    return pd.DataFrame(rows)


def normalised_scores(per_run: pd.DataFrame, baselines: dict) -> tuple:
    """({setting: {task: normalised scores}}, {task: Baseline used}, [tasks left out, with why]).

    A run's score is measured as the normaliser was: the peers' measure at its budget for a
    train_last_100 reference (a task whose runs are on another env version, or short of the
    budget, is left out), else (a bound, a human score) the final score."""
    out, used, left_out = {}, {}, []
    for task, part in per_run.groupby("task", sort=False):
        baseline = baselines.get(task)
        reference = baseline.normaliser() if baseline else None
        if reference is None:
            left_out.append(f"{task} ({_why_not_normalised(baseline)})")
            continue
        why_not = baseline.why_not_comparable(reference, task)
        if why_not is not None:
            left_out.append(f"{task} ({reference['name']}: {why_not}; not comparable)")
            continue
        column = "peer" if measures.measure_of(reference) == "train_last_100" else "final"
        if column == "peer" and not (part["peer"].notna() & (part["peer_budget"] == reference["steps"])).all():
            short = int((part["peer"].isna() | (part["peer_budget"] != reference["steps"])).sum())
            left_out.append(
                f"{task} ({short} of {len(part)} runs short of {reference['name']}'s budget, "
                f"{_steps(reference['steps'])} steps: not comparable)"
            )
            continue
        used[task] = baseline
        for setting, runs_of_setting in part.groupby("setting", sort=False):
            finals = runs_of_setting[column].dropna().to_numpy()
            if len(finals):
                out.setdefault(setting, {})[task] = scores.normalise(
                    finals, baseline.random["score"], reference["score"]
                )
    return out, used, left_out


def _why_not_normalised(baseline: Optional[Baseline]) -> str:
    if baseline is None:
        return "not in baselines.yaml"
    if baseline.random is None:
        return "no random score in baselines.yaml"
    if baseline.normalise_by is None:
        return "no reference to normalise by in baselines.yaml"
    return f"normalise_by names {baseline.normalise_by!r}, which is not among its references"


def aggregate_table(normalised: dict, reps: int, seed: int, confidence: float = scores.CONFIDENCE) -> pd.DataFrame:
    rows = []
    for setting in sorted(normalised, key=runs._natural_key):
        table = normalised[setting]
        row = dict(setting=setting, tasks=len(table), runs=sum(len(v) for v in table.values()))
        for name, interval in scores.aggregate_intervals(table, reps, confidence, seed).items():
            row.update({name: interval.point, f"{name}_low": interval.low, f"{name}_high": interval.high})
        rows.append(row)
    return pd.DataFrame(rows)


# Figures (without pyplot: no global state, no display).


def legend_label(setting: str, width: int = 56) -> str:
    """A setting's label wrapped at its commas: several differing keys would run off the figure."""
    return textwrap.fill(setting.replace(",", ", "), width)


def place_legend(fig: Figure, ax) -> None:
    """In the axes' best corner; below them when a label is wrapped (it would hide the curves), the
    figure made taller by the legend's lines so that the axes keep their height."""
    _, labels = ax.get_legend_handles_labels()
    if any("\n" in label for label in labels):
        lines = sum(label.count("\n") + 1 for label in labels)
        fig.set_figheight(fig.get_figheight() + 0.17 * lines)
        fig.legend(loc="outside lower center", fontsize="small")
    else:
        ax.legend(fontsize="small")


def curve_figure(task: str, task_runs: list, metric: str, baseline: Optional[Baseline], reps: int, seed: int) -> Figure:
    fig = Figure(figsize=(7.2, 4.4), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    drawn = []
    for i, setting in enumerate(settings(task_runs)):
        color = f"C{i % 10}"
        members = [r for r in task_runs if r.setting == setting]
        grid, matrix, held = seed_curves(members, metric)
        if not len(grid):
            continue
        for values in matrix:
            ax.plot(grid, values, color=color, linewidth=0.7, alpha=0.5)
        mean, low, high = scores.mean_band(held, reps=reps, seed=seed)
        label = legend_label(f"{setting} ({len(members)} seed{'s' * (len(members) != 1)})")
        ax.plot(grid, mean, color=color, linewidth=2.0, label=label)
        ax.fill_between(grid, low, high, color=color, alpha=0.2, linewidth=0)
        drawn.append(matrix)
    if baseline is not None:
        _draw_references(ax, baseline, drawn, task)
    ax.set_title(task)
    ax.set_xlabel("agent steps")
    ax.set_ylabel("evaluation return" if metric == "eval" else "training return")
    ax.grid(alpha=0.3)
    place_legend(fig, ax)
    return fig


def seed_curves(runs: list, metric: str) -> tuple:
    """(steps, each run's curve, the curves the mean is taken over) on one grid. A run that stopped
    at its evaluation target holds its last score in the mean from there on: it finished, and
    dropping it would bend the mean down (or up) where it left, showing a change no policy made."""
    runs = [r for r in runs if len(curve(r, metric)[0])]
    grid, matrix = _on_one_grid([curve(r, metric) for r in runs])
    held = matrix.copy()
    for row, run in zip(held, runs):
        last = np.flatnonzero(~np.isnan(row))[-1]
        if met_stop_target(run):
            row[last + 1 :] = row[last]
    return grid, matrix, held


def _on_one_grid(curves: list) -> tuple:
    """Runs' curves on shared steps: the union of their steps (or, if that is more, 200 even ones
    and each run's first and last, so that every run is on the grid however short), each run
    interpolated within its own range and NaN outside it."""
    curves = [(s, v) for s, v in curves if len(s)]
    if not curves:
        return np.array([]), np.empty((0, 0))
    steps = np.unique(np.concatenate([s for s, _ in curves]))
    if len(steps) > 200:
        ends = [s[[0, -1]] for s, _ in curves]
        steps = np.unique(np.concatenate([np.linspace(steps[0], steps[-1], 200), *ends]))
    matrix = np.array([np.interp(steps, s, v, left=np.nan, right=np.nan) for s, v in curves])
    return steps, matrix


def _draw_references(ax, baseline: Baseline, drawn: list, task: str) -> None:
    """Dashed lines for the references that compare with these runs (dotted for random play); one
    far off the runs' scale is named in the legend but not drawn, so that it does not flatten the
    curves. The others are listed in report.md, with why they do not compare."""
    values = np.concatenate([m[np.isfinite(m)] for m in drawn]) if drawn else np.array([])
    low, high = (float(values.min()), float(values.max())) if len(values) else (-np.inf, np.inf)
    span = max(high - low, 1e-9) if len(values) else np.inf
    lines = [dict(name="random", score=baseline.random["score"], steps=None)] if baseline.random else []
    comparable = [r for r in baseline.references if baseline.why_not_comparable(r, task) is None]
    for i, reference in enumerate([*lines, *comparable]):
        label = f"{reference['name']}: {_number(reference['score'])}"
        if reference.get("steps"):
            label += f" at {_steps(reference['steps'])} steps"
        if low - span <= reference["score"] <= high + span:
            style = ":" if reference["name"] == "random" else "--"
            ax.axhline(
                reference["score"], color="0.35" if style == ":" else f"C{(i + 5) % 10}", linestyle=style, label=label
            )
        else:
            ax.plot([], [], linestyle="none", label=f"{label} (off scale)")


def profile_figure(normalised: dict, reps: int, seed: int) -> Figure:
    fig = Figure(figsize=(6.4, 4.4), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    pooled = {f"{s}/{t}": v for s, table in normalised.items() for t, v in table.items()}
    taus = scores.tau_grid(pooled) if pooled else np.linspace(0, 1, 101)
    for i, setting in enumerate(sorted(normalised, key=runs._natural_key)):
        profile = scores.performance_profile(normalised[setting], taus, reps=reps, seed=seed)
        ax.plot(taus, profile.fraction, color=f"C{i % 10}", label=legend_label(setting))
        ax.fill_between(taus, profile.low, profile.high, color=f"C{i % 10}", alpha=0.2, linewidth=0)
    ax.set_xlabel("normalised score τ")
    ax.set_ylabel("fraction of runs with score > τ")
    ax.set_title("Performance profile (final scores)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if normalised:
        place_legend(fig, ax)
    else:
        ax.text(0.5, 0.5, "no task has a random score and a reference", ha="center", va="center")
    return fig


# The report.


@dataclass
class Options:
    metric: str = "auto"
    targets: dict = field(default_factory=dict)  # task -> target; "" -> every task's
    window: int = 100
    reps: int = scores.DEFAULT_REPS
    seed: int = 0
    baselines: Path = BASELINES
    keep_runs: bool = False  # copy what the report reads of each run to OUT/runs (runs.copy_run)


def write_report(paths: Sequence[str | Path], out_dir: str | Path, options: Optional[Options] = None) -> dict:
    """Reads the runs under paths and writes the report to out_dir; returns {name: path}."""
    options = options or Options()
    loaded = load_runs(paths, options.window)
    metric = pick_metric(loaded, options.metric)
    # A job of a sweep still starting (or one that died at start) has no score yet: named, not drawn.
    missing = [r.name for r in loaded if not len(curve(r, metric)[0])]
    loaded = [r for r in loaded if r.name not in missing]
    if not loaded:
        raise FileNotFoundError(f"no run has {NO_SCORE[metric]}" + (": use --metric train" if metric == "eval" else ""))
    baselines = load_baselines(options.baselines)
    per_run = pd.DataFrame(
        [summarise(r, metric, _target(options.targets, r.task), _peer_budget(baselines.get(r.task), r)) for r in loaded]
    )
    table = task_table(per_run, options.reps, options.seed)
    normalised, used, left_out = normalised_scores(per_run, baselines)
    aggregates = aggregate_table(normalised, options.reps, options.seed)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    if options.keep_runs:
        written["runs"] = keep_runs(loaded, out_dir / KEPT_RUNS)
        if _own_baselines(options):  # kept, to draw it again
            written["baselines"] = out_dir / KEPT_BASELINES
            if written["baselines"].resolve() != Path(options.baselines).resolve():
                shutil.copyfile(options.baselines, written["baselines"])
    for task in tasks(loaded):
        task_runs = [r for r in loaded if r.task == task]
        fig = curve_figure(task, task_runs, metric, baselines.get(task), options.reps, options.seed)
        written[f"curve:{task}"] = _save(fig, out_dir / f"curve_{_file_name(task)}.png")
    populations = []
    for population_dir in sorted({p for path in paths for p in population_figures.find_populations(Path(path))}):
        name = _population_name(population_dir, paths)
        fig, summary = population_figures.population_figure(population_dir, name, options.window)
        written[f"population:{name}"] = _save(fig, out_dir / f"population_{_file_name(name)}.png")
        populations += population_figures.markdown(name, written[f"population:{name}"].name, summary)
    written["profile"] = _save(
        profile_figure(normalised, options.reps, options.seed), out_dir / "performance_profile.png"
    )
    written["tasks_csv"] = out_dir / "tasks.csv"
    table.to_csv(written["tasks_csv"], index=False)
    written["aggregates_csv"] = out_dir / "aggregates.csv"
    aggregates.to_csv(written["aggregates_csv"], index=False)
    short = per_run[per_run["unfinished"]].itertuples(index=False)
    unfinished = [f"{r.run} at {_steps(r.steps)} of {_steps(r.total_steps)}" for r in short]
    markdown = render_markdown(
        paths, loaded, metric, missing, table, aggregates, used, left_out, baselines, options, written, unfinished
    )
    if populations:
        markdown += "\n## Populations (population-based training)\n" + "\n".join(populations) + "\n"
    written["report"] = out_dir / "report.md"
    written["report"].write_text(markdown)
    return written


KEPT_RUNS = "runs"
KEPT_BASELINES = "baselines.yaml"  # beside report.md, when the report used a baselines file of its own


def keep_runs(loaded: list, kept: Path) -> Path:
    """Copies what the report reads of each run under kept (named as in the report), replacing an
    earlier copy; a report drawn from kept runs (all of them under kept) keeps them as they are."""
    kept = kept.resolve()
    if all(r.dir.is_relative_to(kept) for r in loaded):
        return kept
    if any(r.dir.is_relative_to(kept) for r in loaded):
        raise ValueError(f"some runs are under {kept} and some are not: draw from the others, or --out elsewhere")
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    (kept / runs.KEPT_MARKER).write_text("copies of runs that a report was drawn from (report --keep-runs)\n")
    for run in loaded:
        name = Path(run.name)
        runs.copy_run(run.dir, kept / (name.relative_to(name.anchor) if name.is_absolute() else name), run.tests)
    return kept


def _population_name(population_dir: Path, paths: Sequence) -> str:
    """A population's name in the report: its dir relative to the path it was found under."""
    for path in paths:
        path = Path(path).resolve()
        if population_dir.resolve().is_relative_to(path):
            return str(population_dir.resolve().relative_to(path.parent))
    return str(population_dir)


def _peer_budget(baseline: Optional[Baseline], run: Run) -> Optional[float]:
    """Where a run's peers' measure is read: at its task's reference's budget when the run was meant
    to reach it (its total_steps), else at its own total_steps (and then not compared)."""
    budget = baseline.peer_budget() if baseline is not None else None
    total_steps = run.config.get("total_steps")
    if budget is None or (isinstance(total_steps, (int, float)) and total_steps < budget):
        return total_steps
    return budget


def _target(targets: dict, task: str) -> Optional[float]:
    return targets.get(task, targets.get(""))


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path


def _file_name(task: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", task)


def render_markdown(
    paths, loaded, metric, missing, table, aggregates, used, left_out, baselines, options, written, unfinished=()
) -> str:
    """unfinished: `RUN at STEPS of TOTAL` for each run short of its total_steps."""
    what = (
        "evaluation return (eval.csv's mean_return; the last evaluation is the final score)"
        if metric == "eval"
        else f"training return (the mean of the last {options.window} episodes at each logs.csv row; "
        "its last value is the final score)"
    )
    lines = [
        "# Report",
        "",
        f"{len(loaded)} run{'s' * (len(loaded) != 1)} in {', '.join(str(p) for p in paths)}.",
        f"Score: {what}.",
        "Peers' measure, beside it: the mean of the last 100 training episodes (sampled actions) that ended by "
        "the first update at or past the budget (the task's published reference's, else the run's total_steps), "
        "as CleanRL and openrlbenchmark report theirs.",
        f"Spread over seeds: with {measures.MIN_SEEDS_FOR_INTERVAL} seeds or more, a {scores.CONFIDENCE:.0%} "
        f"percentile bootstrap interval of the mean ({options.reps:,} replicates, seed {options.seed}); with "
        "fewer, the seeds' range (min, max), since such an interval is little more than the range "
        "(with 3 seeds it covers ~75%, not 95%). Across tasks: stratified bootstrap intervals "
        "(each task's runs resampled on their own), with the same caveat where tasks have few runs.",
    ]
    if "runs" in written:
        lines.append(
            f"The runs' logs are kept in {KEPT_RUNS}/ (what this report reads of them): `{_redraw_command(options)}`, "
            "run in this dir, draws it again."
        )
    if missing:
        lines.append(f"Left out, no {NO_SCORE[metric]}: {', '.join(missing)}.")
    if unfinished:
        lines.append(f"Unfinished, their last score standing in for the final one: {', '.join(unfinished)}.")
    with_evals = sum(r.evals is not None for r in loaded)
    if options.metric == "auto" and metric == "train" and with_evals:  # auto fell back: not every run has them
        lines.append(
            f"Only {with_evals} of {len(loaded)} runs have an eval.csv, so none is used (--metric eval: those)."
        )
    pooled = [r for r in loaded if r.evals is not None and _final_pool(r)[0] > 1]
    if metric == "eval" and pooled:
        lines.append(
            "Pooled: "
            + "; ".join(
                f"{r.name}'s final score pools {_final_pool(r)[0]} evaluations ({_final_pool(r)[1]} episodes) "
                f"at step {_steps(r.evals['step'].max())}"
                for r in pooled
            )
            + " (the periodic evaluation and mode=test's, weighted by their episodes)."
        )
    lines += [
        "Per task, final, best and the peers' measure: the mean over seeds [interval] or (range); steps to "
        "target: the median over the seeds that reached it, how many did, and the best the others reached; "
        "training time: logs.csv's time_s (across resumes); steps/s: steps / training time.",
        "Curves: each seed thin, the mean over seeds bold with its 95% bootstrap band (with fewer than "
        f"{measures.MIN_SEEDS_FOR_INTERVAL} seeds, close to the seeds' range); a seed that stopped at its evaluation "
        "target holds its last score in the mean.",
    ]
    for task in tasks(loaded):
        lines += ["", f"## {task}", "", f"![{task}]({written[f'curve:{task}'].name})", ""]
        lines += _task_markdown(table[table["task"] == task], _target(options.targets, task), metric)
        lines += _references_markdown(baselines.get(task), task)
    lines += ["", "## Across tasks (normalised final scores)", ""]
    lines += _aggregate_markdown(aggregates, used, left_out, written)
    return "\n".join(lines) + "\n"


def _redraw_command(options: Options) -> str:
    """The command that draws this report again from its kept runs, with the options that shape it."""
    words = ["python -m torchbeast_hydra.logs.report", KEPT_RUNS, "--out ."]
    words += [f"--target {f'{task}=' if task else ''}{_exact(value)}" for task, value in options.targets.items()]
    if _own_baselines(options):
        words.append(f"--baselines {KEPT_BASELINES}")
    if options.metric != "auto":
        words.append(f"--metric {options.metric}")
    defaults = Options()
    words += [
        f"--{name} {getattr(options, name)}"
        for name in ("window", "reps", "seed")
        if getattr(options, name) != getattr(defaults, name)
    ]
    return " ".join(words)


def _own_baselines(options: Options) -> bool:
    """Whether the report normalises by a baselines file other than the package's."""
    return Path(options.baselines).resolve() != BASELINES.resolve()


def _exact(value: float) -> str:
    """A number as short as it can be written and still read back the same."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def _task_markdown(rows: pd.DataFrame, target: Optional[float], metric: str) -> list:
    target_header = f"steps to {target:g}" if target is not None else "steps to target"
    budgets = rows["peer_budget"].dropna().unique()
    at = f" at {_steps(budgets[0])} steps" if len(budgets) == 1 else " at each run's total_steps"
    ours = "evaluation" if metric == "eval" else "training, last 100"
    lines = [
        f"| setting | seeds | final ({ours}) | best | last 100 training episodes{at} | {target_header} | "
        "training time | steps/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.itertuples(index=False):
        if target is None:
            reach = "-"
        elif row.reached:
            reach = f"{_steps(row.steps_to_target)} ({row.reached}/{row.seeds} seeds)"
        else:
            reach = f"not reached (0/{row.seeds} seeds)"
        if target is not None and row.others_best:
            reach += f"; the others' best: {row.others_best.replace(';', ', ')}"
        seeds = f"{row.seeds} ({row.unfinished} unfinished)" if row.unfinished else f"{row.seeds}"
        peer = _spread(row.peer, row.peer_low, row.peer_high, row.spread)
        if row.peer_seeds < row.seeds:
            peer += f" ({row.peer_seeds}/{row.seeds} seeds reached the budget)"
        lines.append(
            f"| {row.setting} | {seeds} | {_spread(row.final, row.final_low, row.final_high, row.spread)} | "
            f"{_spread(row.best, row.best_low, row.best_high, row.spread)} | {peer} | {reach} | "
            f"{_duration(row.wall_s)} | {_number(row.sps)} |"
        )
    return lines


def _spread(point: float, low: float, high: float, kind: str) -> str:
    """'1,853 (range 1,133 to 2,224)' for few seeds, '1,853 [1,133, 2,224]' for an interval."""
    if kind == "one seed":
        return _number(point)
    if kind == "range" and not np.isnan(point):
        return f"{_number(point)} (range {_number(low)} to {_number(high)})"
    return _with_interval(point, low, high)


def _references_markdown(baseline: Optional[Baseline], task: str) -> list:
    """Each reference with its measure, env, budget and seeds, and whether it compares with these runs."""
    if baseline is None:
        return ["", "No published reference for this task in baselines.yaml."]
    lines = [""]
    if baseline.random:
        lines.append(f"- random: {_number(baseline.random['score'])} ({baseline.random['source']})")
    for reference in baseline.references:
        measure = measures.measure_of(reference)
        facts = [measures.MEASURES[measure]]
        if measure not in measures.ANCHORS:
            facts.append(f"on {reference.get('env') or baseline.task}")
        if reference.get("steps"):
            facts.append(f"at {_steps(reference['steps'])} steps")
        if reference.get("seeds"):
            facts.append(f"{reference['seeds']} seeds")
        why_not = baseline.why_not_comparable(reference, task)
        if measure == "other":
            facts[0] = why_not  # what it is: how it was measured
            verdict = "shown, not compared"
        elif why_not is not None:
            verdict = f"not comparable with these runs: {why_not}"
        elif measure == "train_last_100":
            verdict = "compared with the runs' last 100 training episodes at its budget"
        else:
            verdict = "an anchor: compared with the runs' final score"
        lines.append(
            f"- {reference['name']}: {_number(reference['score'])}, {', '.join(facts)}; {verdict} "
            f"({reference['source']})"
        )
    if baseline.notes:
        lines.append(f"- notes: {baseline.notes}")
    return lines


def _aggregate_markdown(aggregates: pd.DataFrame, used: dict, left_out: list, written: dict) -> list:
    if aggregates.empty:
        return ["No task has both a random score and a comparable reference to normalise by (baselines.yaml)."] + (
            [f"Left out: {', '.join(left_out)}."] if left_out else []
        )
    by = "; ".join(f"{task} by {b.normalise_by} ({_normalised_measure(b)})" for task, b in sorted(used.items()))
    lines = [
        f"Normalised score: (score - random) / (reference - random), 0 = random play, 1 = the reference, "
        f"each run measured as the reference was: {by}.",
    ]
    if left_out:
        lines.append(f"Left out: {', '.join(left_out)}.")
    names = list(scores.AGGREGATES)
    lines += [
        "",
        f"| setting | tasks | runs | {' | '.join(names)} |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for row in aggregates.to_dict("records"):
        cells = [_with_interval(row[n], row[f"{n}_low"], row[f"{n}_high"], digits=3) for n in names]
        lines.append(f"| {row['setting']} | {row['tasks']} | {row['runs']} | {' | '.join(cells)} |")
    lines += [
        "",
        "IQM: the mean of the middle 50% of all runs' scores; median and mean: of the per-task means; "
        f"optimality gap: the mean shortfall below {scores.GAMMA:g} (Agarwal et al. 2021). [95% stratified bootstrap "
        "interval]",
        "",
        f"![performance profile]({written['profile'].name})",
    ]
    return lines


def _normalised_measure(baseline: Baseline) -> str:
    reference = baseline.normaliser()
    if measures.measure_of(reference) == "train_last_100":
        return f"the last 100 training episodes at {_steps(reference['steps'])} steps"
    return "the final score"


def _with_interval(point: float, low: float, high: float, digits: Optional[int] = None) -> str:
    if np.isnan(point):
        return "-"
    show = (lambda x: f"{x:.{digits}f}") if digits is not None else _number
    return f"{show(point)} [{show(low)}, {show(high)}]"


def _number(x: float) -> str:
    if x is None or np.isnan(x):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _steps(x: float) -> str:
    return f"{int(round(x)):,}"


def _duration(seconds: float) -> str:
    if np.isnan(seconds):
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


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
        prog="python -m torchbeast_hydra.logs.report",
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
        "--baselines", type=Path, default=BASELINES, help="the reference scores (default: the packaged baselines.yaml)"
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
