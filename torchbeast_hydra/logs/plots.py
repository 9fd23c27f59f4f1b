"""Plots of runs and sweeps loaded by `runs`: learning curves with seeds aggregated per swept
setting (the mean, and a band of ± one standard deviation), and final returns.

Figures are made without pyplot (no global state, no display needed) and saved as PNGs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
from matplotlib.figure import Figure

from torchbeast_hydra.logs import runs

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
