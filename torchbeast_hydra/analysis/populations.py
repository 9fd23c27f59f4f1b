"""A population's figures (population-based training, torchbeast_hydra/pbt/): every member's
training curve with its exploits marked, and the best member's hyperparameter schedule.

Read from the population's lineage table (pbt.csv) and its members' logs.csv, found through the
table's run_dir column (relative to the population's dir, so a sweep dir moved whole still reads).
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from torchbeast_hydra.logs import lineage as population
from torchbeast_hydra.logs.metrics import logs_file, read_rows, recent_means

DPI = 100
FIXED_COLUMNS = set(population.COLUMNS)


def find_populations(path: Path) -> list[Path]:
    """The population dirs (holding pbt.csv) at or under path."""
    path = Path(path)
    return sorted(table.parent for table in path.rglob(population.TABLE))


def member_curves(population_dir: Path, window: int = 100) -> dict[int, tuple[list, list]]:
    """member -> (steps, mean of its last `window` training episodes at each logs.csv row)."""
    run_dirs = {}
    for row in population.read_table(population_dir):
        if row["run_dir"]:
            run_dirs[row["member"]] = population_dir / row["run_dir"]
    curves = {}
    for member, run_dir in sorted(run_dirs.items()):
        if logs_file(run_dir) is None:
            continue
        rows = read_rows(run_dir)
        means = recent_means((row["episode_returns"] for row in rows), window)
        kept = [(row["step"], mean) for row, mean in zip(rows, means) if mean is not None]
        curves[member] = ([s for s, _ in kept], [m for _, m in kept])
    return curves


def schedule(rows: list[dict], member: int) -> tuple[list, dict]:
    """The steps at which member's values changed (its start, resumes, exploits) and each mutated
    key's value from each of those steps on."""
    keys = [key for key in (rows[0] if rows else {}) if key not in FIXED_COLUMNS]
    mine = [row for row in rows if row["member"] == member and row["event"] in ("start", "resume", "exploit")]
    return [row["step"] for row in mine], {key: [row[key] for row in mine] for key in keys}


def population_figure(population_dir: Path, title: str, window: int = 100) -> tuple[Figure, dict]:
    """Two panels: the members' curves (an x where a member copied another), and the best member's
    values against its steps (a step function, log scale). Returns the figure and a summary."""
    rows = population.read_table(population_dir)
    curves = member_curves(population_dir, window)
    best, best_row = population.best_member(population_dir)
    fig = Figure(figsize=(12.8, 4.4), dpi=DPI, layout="constrained")
    left, right = fig.subplots(1, 2)
    for member, (steps, means) in curves.items():
        color = f"C{member % 10}"
        left.plot(steps, means, color=color, lw=2.2 if member == best else 1.0, label=f"member {member}")
        for row in rows:
            if row["member"] == member and row["event"] == "exploit" and steps:
                at = min(range(len(steps)), key=lambda i: abs(steps[i] - row["step"]))
                left.plot(steps[at], means[at], "x", color=color, ms=7)
    left.set(xlabel="agent steps", ylabel=f"training return (last {window} episodes)", title=f"{title}: members")
    left.legend(fontsize="small", ncols=2)
    changed_at, values = schedule(rows, best)
    end = max(curves[best][0]) if best in curves and curves[best][0] else (changed_at[-1] if changed_at else 0)
    for i, (key, series) in enumerate(values.items()):
        if not series or any(v is None for v in series):
            continue
        right.step([*changed_at, end], [*series, series[-1]], where="post", color=f"C{i}", label=key)
    right.set(xlabel="agent steps", ylabel="value", title=f"{title}: member {best}'s values (the best)")
    if any(v and v > 0 for series in values.values() for v in series):
        right.set_yscale("log")
    right.legend(fontsize="small")
    exploits = [row for row in rows if row["event"] == "exploit"]
    summary = dict(
        best=best,
        best_score=best_row["score"],
        best_step=best_row["step"],
        members=len({row["member"] for row in rows}),
        exploits=len(exploits),
        best_lineage=[(row["step"], row["exploited_from"]) for row in exploits if row["member"] == best],
        final_values={key: series[-1] for key, series in values.items() if series},
    )
    return fig, summary


def markdown(name: str, image: str, summary: dict) -> list[str]:
    """report.md's lines for one population."""
    values = ", ".join(f"{key}={value:.3g}" for key, value in summary["final_values"].items() if value is not None)
    lineage = ", ".join(f"at step {step:,} from member {source}" for step, source in summary["best_lineage"]) or "none"
    score = summary["best_score"]
    return [
        "",
        f"### Population {name}",
        "",
        f"![population {name}]({image})",
        "",
        f"{summary['members']} members, {summary['exploits']} exploits in all (pbt.csv). Best member: "
        f"{summary['best']}, score {'n/a' if math.isnan(score) else f'{score:.1f}'} at step {summary['best_step']:,}; "
        f"its copies: {lineage}; its last values: {values or 'none'}.",
    ]
