"""Figures of runs and sweeps, made without pyplot (no global state, no display needed) and saved
as PNGs.

The plot command's (over `runs.load_runs`' DataFrame): learning curves with seeds aggregated per
swept setting (the mean, and a band of ± one standard deviation), and final returns. The report's
(over `runs.load`'s runs): per task the score against agent steps, per setting the mean over seeds
with a bootstrap band and each seed thin, published references dashed; the performance profile.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from torchbeast_hydra.analysis import formatting, runs, scores, tables
from torchbeast_hydra.analysis.baselines import Baseline

DPI = 100


def curves_figure(
    df: pd.DataFrame, metrics: Sequence[str], titles: Optional[Sequence[str]] = None, bins: int = 100, columns: int = 2
) -> Figure:
    """One panel per metric against steps; per setting, the mean across runs and a ± std band."""
    metrics = [m for m in metrics if m in df.columns and df[m].notna().any()]
    titles = list(titles or metrics)
    columns = max(1, min(columns, len(metrics)))
    rows = max(1, -(-len(metrics) // columns))
    fig = Figure(figsize=(6.4 * columns, 4.0 * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, metric, title in zip(axes, metrics, titles):
        curve = runs.learning_curve(df, metric, bins=bins)
        for i, (setting, part) in enumerate(curve.groupby("setting", sort=False)):
            color = f"C{i % 10}"
            count = int(part["runs"].max())
            ax.plot(part["step"], part["mean"], color=color, label=f"{setting} ({count} run{'s' * (count > 1)})")
            ax.fill_between(
                part["step"],
                part["mean"] - part["std"],
                part["mean"] + part["std"],
                color=color,
                alpha=0.2,
                linewidth=0,
            )
        ax.set_title(title)
        ax.set_xlabel("steps")
        ax.grid(alpha=0.3)
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    if metrics:
        axes[0].legend(fontsize="small")
    else:
        axes[0].text(0.5, 0.5, "nothing logged yet", ha="center", va="center")
    return fig


def returns_figure(df: pd.DataFrame, bins: int = 100) -> Figure:
    window = df.attrs.get("window")
    title = f"Return (mean of the last {window} episodes)" if window else "Return"
    return curves_figure(df, [runs.RETURN], [title], bins=bins, columns=1)


def sps_figure(df: pd.DataFrame, bins: int = 100) -> Figure:
    return curves_figure(df, ["sps"], ["Steps per second"], bins=bins, columns=1)


def losses_figure(df: pd.DataFrame, bins: int = 100) -> Figure:
    return curves_figure(df, runs.loss_columns(df), bins=bins, columns=2)


def final_returns_figure(table: pd.DataFrame) -> Figure:
    """Bars of final_returns_by_setting: the mean across runs, error bars of one std."""
    fig = Figure(figsize=(max(6.4, 1.2 * len(table) + 2), 4.0), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    positions = range(len(table))
    ax.bar(positions, table["mean"], yerr=table["std"].fillna(0.0), capsize=4, color=[f"C{i % 10}" for i in positions])
    ax.set_xticks(list(positions), [str(s) for s in table.index], rotation=20, ha="right", fontsize="small")
    ax.set_ylabel("final return")
    ax.set_title("Final return per setting (mean ± std across runs)")
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_all(df: pd.DataFrame, out_dir: str | Path, last_n: int = 100, bins: int = 100) -> dict:
    """Writes returns.png, sps.png, losses.png, final_returns.png and final_returns.csv to out_dir.

    Returns {name: path}.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = runs.final_returns_by_setting(df, last_n)
    figures = dict(
        returns=returns_figure(df, bins),
        sps=sps_figure(df, bins),
        losses=losses_figure(df, bins),
        final_returns=final_returns_figure(table),
    )
    paths = {}
    for name, fig in figures.items():
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name])
    paths["final_returns_table"] = out_dir / "final_returns.csv"
    table.to_csv(paths["final_returns_table"])
    return paths


# The report's figures.


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
    for i, setting in enumerate(runs.setting_names(task_runs)):
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
        _draw_references(ax, baseline, drawn, task, [r.config for r in task_runs])
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
    runs = [r for r in runs if len(tables.curve(r, metric)[0])]
    grid, matrix = on_one_grid([tables.curve(r, metric) for r in runs])
    held = matrix.copy()
    for row, run in zip(held, runs):
        last = np.flatnonzero(~np.isnan(row))[-1]
        if tables.met_stop_target(run):
            row[last + 1 :] = row[last]
    return grid, matrix, held


def on_one_grid(curves: list) -> tuple:
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


def _draw_references(ax, baseline: Baseline, drawn: list, task: str, configs=()) -> None:
    """Dashed lines for the references that compare with these runs (dotted for random play); one
    far off the runs' scale is named in the legend but not drawn, so that it does not flatten the
    curves. The others are listed in report.md, with why they do not compare."""
    values = np.concatenate([m[np.isfinite(m)] for m in drawn]) if drawn else np.array([])
    low, high = (float(values.min()), float(values.max())) if len(values) else (-np.inf, np.inf)
    span = max(high - low, 1e-9) if len(values) else np.inf
    lines = [dict(name="random", score=baseline.random["score"], steps=None)] if baseline.random else []
    # A reference whose env settings only some runs have is drawn for those (report.md says which).
    comparable = [
        r
        for r in baseline.references
        if baseline.why_not_comparable(r, task) is None
        and (not configs or any(baseline.why_not_comparable(r, task, [c]) is None for c in configs))
    ]
    for i, reference in enumerate([*lines, *comparable]):
        label = f"{reference['name']}: {formatting.number(reference['score'])}"
        if reference.get("steps"):
            label += f" at {formatting.steps(reference['steps'])} steps"
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
    for i, setting in enumerate(sorted(normalised, key=runs.natural_key)):
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
