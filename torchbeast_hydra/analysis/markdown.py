"""report.md: what was read and how it was scored, per task its curve, table and published
references, and across tasks the aggregates of the normalised scores."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from torchbeast_hydra.analysis import baselines, formatting, measures, runs, scores, tables


def render_markdown(paths, scored: tables.Scored, options, written: dict) -> str:
    """report.md from what the report computed (tables.Scored) and the files it wrote."""
    loaded, metric, table, per_run = scored.loaded, scored.metric, scored.table, scored.per_run
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
        "Peers' measure, beside it: the training episodes (sampled actions) read as the task's published "
        "reference read its, at its budget (else at the run's total_steps): the mean of the last 100 that ended by "
        "the first update at or past the budget (CleanRL's, openrlbenchmark's), or, for a reference given per "
        "iteration (Dopamine's), the mean of those that ended within the last iteration before it.",
        f"Spread over seeds: with {measures.MIN_SEEDS_FOR_INTERVAL} seeds or more, a {scores.CONFIDENCE:.0%} "
        f"percentile bootstrap interval of the mean ({options.reps:,} replicates, seed {options.seed}); with "
        "fewer, the seeds' range (min, max), since such an interval is little more than the range "
        "(with 3 seeds it covers ~75%, not 95%). Across tasks: stratified bootstrap intervals "
        "(each task's runs resampled on their own), with the same caveat where tasks have few runs.",
    ]
    if "runs" in written:
        lines.append(
            f"The runs' logs are kept in {runs.KEPT_RUNS}/ (what this report reads of them): "
            f"`{_redraw_command(options)}`, run in this dir, draws it again."
        )
    if scored.missing:
        lines.append(f"Left out, no {tables.NO_SCORE[metric]}: {', '.join(scored.missing)}.")
    if scored.unfinished:
        lines.append(f"Unfinished, their last score standing in for the final one: {', '.join(scored.unfinished)}.")
    with_evals = sum(r.evals is not None for r in loaded)
    if options.metric == "auto" and metric == "train" and with_evals:  # auto fell back: not every run has them
        lines.append(
            f"Only {with_evals} of {len(loaded)} runs have an eval.csv, so none is used (--metric eval: those)."
        )
    pooled = [r for r in loaded if r.evals is not None and tables.final_pool(r)[0] > 1]
    if metric == "eval" and pooled:
        lines.append(
            "Pooled: "
            + "; ".join(
                f"{r.name}'s final score pools {tables.final_pool(r)[0]} evaluations "
                f"({tables.final_pool(r)[1]} episodes) "
                f"at step {formatting.steps(r.evals['step'].max())}"
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
    for task in runs.task_names(loaded):
        lines += ["", f"## {task}", "", f"![{task}]({written[f'curve:{task}'].name})", ""]
        lines += _task_markdown(table[table["task"] == task], options.target(task), metric)
        lines += _runs_markdown(per_run[per_run["task"] == task], metric)
        configs = [r.config for r in loaded if r.task == task]
        budgets = per_run[per_run["task"] == task]["peer_budget"].dropna().tolist()
        lines += _references_markdown(scored.known.get(task), task, configs, budgets)
    lines += ["", "## Across tasks (normalised final scores)", ""]
    lines += _aggregate_markdown(scored.aggregates, scored.used, scored.left_out, written)
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


def _task_markdown(rows: pd.DataFrame, target: Optional[float], metric: str) -> list:
    target_header = f"steps to {target:g}" if target is not None else "steps to target"
    budgets = rows["peer_budget"].dropna().unique()
    at = f" at {formatting.steps(budgets[0])} steps" if len(budgets) == 1 else " at each run's total_steps"
    ours = "evaluation" if metric == "eval" else "training, last 100"
    lines = [
        f"| setting | seeds | final ({ours}) | best | {_peer_label(rows)}{at} | {target_header} | "
        "training time | steps/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.itertuples(index=False):
        if target is None:
            reach = "-"
        elif row.reached:
            reach = f"{formatting.steps(row.steps_to_target)} ({row.reached}/{row.seeds} seeds)"
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
            f"{formatting.duration(row.wall_s)} | {formatting.number(row.sps)} |"
        )
    return lines


def _runs_markdown(rows: pd.DataFrame, metric: str) -> list:
    """Each run's final score beside the peers' measure, with the episodes and the step it was read at."""
    ours = "evaluation" if metric == "eval" else "training, last 100"
    lines = ["", f"| run | seed | final ({ours}) | {_peer_label(rows)} |", "|---|---|---|---|"]
    for row in rows.itertuples(index=False):
        if np.isnan(row.peer):
            peer = f"- (short of {formatting.steps(row.peer_budget)} steps)" if not np.isnan(row.peer_budget) else "-"
        else:
            at = formatting.steps(row.peer_step)
            peer = f"{formatting.number(row.peer)} ({row.peer_episodes} episodes, at step {at})"
        if isinstance(row.peer_other_settings, str) and row.peer_other_settings:  # not the reference's protocol
            peer += f"; not comparable: {row.peer_other_settings}"
        seed = "-" if row.seed is None or (isinstance(row.seed, float) and np.isnan(row.seed)) else int(row.seed)
        lines.append(f"| {row.run} | {seed} | {formatting.number(row.final)} | {peer} |")
    return lines


def _peer_label(rows: pd.DataFrame) -> str:
    """The peer figure's column name: its measure (one per task: its peer reference's)."""
    if "peer_measure" in rows and len(rows) and rows["peer_measure"].iloc[0] == "train_iteration":
        return f"training episodes of the last {formatting.steps(rows['peer_iteration_steps'].iloc[0])} steps"
    return "last 100 training episodes"


def _spread(point: float, low: float, high: float, kind: str) -> str:
    """'1,853 (range 1,133 to 2,224)' for few seeds, '1,853 [1,133, 2,224]' for an interval."""
    if kind == "one seed":
        return formatting.number(point)
    if kind == "range" and not np.isnan(point):
        return f"{formatting.number(point)} (range {formatting.number(low)} to {formatting.number(high)})"
    return formatting.with_interval(point, low, high)


def _references_markdown(baseline: Optional[baselines.Baseline], task: str, configs=(), budgets=()) -> list:
    """Each reference with its measure, env, budget and seeds, and whether it compares with these runs
    (their flattened configs: a reference's env_settings must be theirs; the budgets their peers'
    measure was read at: a measured reference's own, or the runs fall short of it)."""
    if baseline is None:
        return ["", "No published reference for this task in baselines.yaml."]
    lines = [""]
    if baseline.random:
        lines.append(f"- random: {formatting.number(baseline.random['score'])} ({baseline.random['source']})")
    for reference in baseline.references:
        measure = measures.measure_of(reference)
        facts = [measures.MEASURES[measure]]
        if measure not in measures.ANCHORS:
            facts.append(f"on {reference.get('env') or baseline.task}")
        if reference.get("iteration_steps"):
            facts.append(f"an iteration of {formatting.steps(reference['iteration_steps'])} steps")
        if reference.get("env_settings"):
            facts.append(", ".join(f"env.{k}={v}" for k, v in reference["env_settings"].items()))
        if reference.get("steps"):
            facts.append(f"at {formatting.steps(reference['steps'])} steps")
        if reference.get("seeds"):
            facts.append(f"{reference['seeds']} seeds")
        why_not = baseline.why_not_comparable(reference, task, configs)
        if measure == "other":
            facts[0] = why_not  # what it is: how it was measured
            verdict = "shown, not compared"
        elif why_not is not None and _of_its_protocol(baseline, reference, task, configs):
            some = _of_its_protocol(baseline, reference, task, configs)
            verdict = f"compared with the {some} of {len(configs)} runs that have its env settings only: {why_not}"
        elif why_not is not None:
            verdict = f"not comparable with these runs: {why_not}"
        elif measure in measures.FROM_TRAINING and any(b != reference.get("steps") for b in budgets):
            short = formatting.steps(min(budgets))
            verdict = f"its measure, but these runs were read at {short} steps, short of its budget: not compared"
        elif measure == "train_last_100":
            verdict = "compared with the runs' last 100 training episodes at its budget"
        elif measure == "train_iteration":
            verdict = "compared with the runs' training episodes of its last iteration before its budget"
        else:
            verdict = "an anchor: compared with the runs' final score"
        lines.append(
            f"- {reference['name']}: {formatting.number(reference['score'])}, {', '.join(facts)}; {verdict} "
            f"({reference['source']})"
        )
    if baseline.notes:
        lines.append(f"- notes: {baseline.notes}")
    return lines


def _of_its_protocol(baseline: baselines.Baseline, reference: dict, task: str, configs) -> int:
    """How many of the runs (flattened configs) compare with the reference one by one."""
    return sum(baseline.why_not_comparable(reference, task, [config]) is None for config in configs)


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


def _normalised_measure(baseline: baselines.Baseline) -> str:
    reference = baseline.normaliser()
    if measures.measure_of(reference) == "train_last_100":
        return f"the last 100 training episodes at {formatting.steps(reference['steps'])} steps"
    if measures.measure_of(reference) == "train_iteration":
        return (
            f"the training episodes of the last {formatting.steps(reference['iteration_steps'])} steps "
            f"before {formatting.steps(reference['steps'])}"
        )
    return "the final score"
