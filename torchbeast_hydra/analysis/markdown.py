"""report.md: what was read and how it was scored, per task its curve, table and published
references, and across tasks the aggregates of the normalised scores."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from torchbeast_hydra.analysis import baselines, formatting, runs, scores, tables


def render_markdown(
    paths, loaded, metric, missing, table, aggregates, used, left_out, known, options, written, unfinished=()
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
        f"Intervals: {scores.CONFIDENCE:.0%}, percentile bootstrap over seeds ({options.reps:,} replicates, "
        f"seed {options.seed}); across tasks, stratified (each task's runs resampled on their own).",
    ]
    if "runs" in written:
        lines.append(
            f"The runs' logs are kept in {runs.KEPT_RUNS}/ (what this report reads of them): "
            f"`{_redraw_command(options)}`, run in this dir, draws it again."
        )
    if missing:
        lines.append(f"Left out, no {tables.NO_SCORE[metric]}: {', '.join(missing)}.")
    if unfinished:
        lines.append(f"Unfinished, their last score standing in for the final one: {', '.join(unfinished)}.")
    with_evals = sum(r.evals is not None for r in loaded)
    if options.metric == "auto" and metric == "train" and with_evals:  # auto fell back: not every run has them
        lines.append(
            f"Only {with_evals} of {len(loaded)} runs have an eval.csv, so none is used (--metric eval: those)."
        )
    lines += [
        "Per task, final and best: the mean over seeds [95% interval]; steps to target: the median over the "
        "seeds that reached it; training time: logs.csv's time_s (across resumes); steps/s: steps / training time.",
        "Curves: each seed thin, the mean over seeds bold with its 95% band; a seed that stopped at its evaluation "
        "target holds its last score in the mean.",
    ]
    for task in runs.task_names(loaded):
        lines += ["", f"## {task}", "", f"![{task}]({written[f'curve:{task}'].name})", ""]
        lines += _task_markdown(table[table["task"] == task], options.target(task))
        lines += _references_markdown(known.get(task))
    lines += ["", "## Across tasks (normalised final scores)", ""]
    lines += _aggregate_markdown(aggregates, used, left_out, written)
    return "\n".join(lines) + "\n"


def _redraw_command(options) -> str:
    """The command that draws this report again from its kept runs, with the options that shape it."""
    words = ["python -m torchbeast_hydra.analysis.report", runs.KEPT_RUNS, "--out ."]
    words += [
        f"--target {f'{task}=' if task else ''}{formatting.exact(value)}" for task, value in options.targets.items()
    ]
    if not baselines.is_packaged(options.baselines):
        words.append(f"--baselines {baselines.KEPT_BASELINES}")
    if options.metric != "auto":
        words.append(f"--metric {options.metric}")
    defaults = type(options)()
    words += [
        f"--{name} {getattr(options, name)}"
        for name in ("window", "reps", "seed")
        if getattr(options, name) != getattr(defaults, name)
    ]
    return " ".join(words)


def _task_markdown(rows: pd.DataFrame, target: Optional[float]) -> list:
    target_header = f"steps to {target:g}" if target is not None else "steps to target"
    lines = [
        f"| setting | seeds | final | best | {target_header} | training time | steps/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows.itertuples(index=False):
        if target is None:
            reach = "-"
        elif row.reached:
            reach = f"{formatting.steps(row.steps_to_target)} ({row.reached}/{row.seeds} seeds)"
        else:
            reach = f"not reached (0/{row.seeds} seeds)"
        seeds = f"{row.seeds} ({row.unfinished} unfinished)" if row.unfinished else f"{row.seeds}"
        lines.append(
            f"| {row.setting} | {seeds} | {formatting.with_interval(row.final, row.final_low, row.final_high)} | "
            f"{formatting.with_interval(row.best, row.best_low, row.best_high)} | {reach} | "
            f"{formatting.duration(row.wall_s)} | {formatting.number(row.sps)} |"
        )
    return lines


def _references_markdown(baseline: Optional[baselines.Baseline]) -> list:
    if baseline is None:
        return ["", "No published reference for this task in baselines.yaml."]
    lines = [""]
    if baseline.random:
        lines.append(f"- random: {formatting.number(baseline.random['score'])} ({baseline.random['source']})")
    for reference in baseline.references:
        at = f" at {formatting.steps(reference['steps'])} steps" if reference.get("steps") else ""
        lines.append(f"- {reference['name']}: {formatting.number(reference['score'])}{at} ({reference['source']})")
    return lines


def _aggregate_markdown(aggregates: pd.DataFrame, used: dict, left_out: list, written: dict) -> list:
    if aggregates.empty:
        return ["No task has both a random score and a reference to normalise by (baselines.yaml)."] + (
            [f"Left out: {', '.join(left_out)}."] if left_out else []
        )
    by = "; ".join(f"{task} by {b.normalise_by}" for task, b in sorted(used.items()))
    lines = [
        f"Normalised score: (score - random) / (reference - random), 0 = random play, 1 = the reference: {by}.",
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
        cells = [formatting.with_interval(row[n], row[f"{n}_low"], row[f"{n}_high"], digits=3) for n in names]
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
