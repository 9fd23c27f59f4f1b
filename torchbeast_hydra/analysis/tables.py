"""The report's numbers: each run's score curve and summary, per task and setting a table with
bootstrap intervals over seeds, and across tasks the normalised scores' aggregates (scores.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from torchbeast_hydra.analysis import formatting, measures, runs, scores
from torchbeast_hydra.analysis.baselines import why_not_normalised
from torchbeast_hydra.analysis.runs import Run
from torchbeast_hydra.logs.metrics import target_met


@dataclass
class Scored:
    """What a report computed from its runs, for report.md (markdown.py) and the csv files."""

    loaded: list  # the runs that have a score
    metric: str  # "eval" or "train"
    missing: list  # names of runs with no score yet
    per_run: pd.DataFrame  # summarise's rows: each run's figures
    table: pd.DataFrame  # per task and setting (task_table)
    aggregates: pd.DataFrame  # across tasks (aggregate_table)
    used: list  # tasks in the aggregates
    left_out: dict  # task -> why it is not
    known: dict  # task -> its baselines.Baseline
    unfinished: list = field(default_factory=list)  # `RUN at STEPS of TOTAL`, runs short of their total_steps


NO_SCORE = {"eval": "evaluation yet", "train": "finished episode yet"}  # what a run without a score lacks


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


def summarise(
    run: Run, metric: str, target: Optional[float], budget: Optional[float] = None, reference: Optional[dict] = None
) -> dict:
    """Final and best score, the first step at or above target, training time and steps/s; the
    peer figure at budget (default: the run's total_steps), on the measure of `reference` (the
    task's peer reference: baselines.Baseline.peer_reference), else the last 100 training episodes,
    and which env settings of the reference the run lacks ("" if none); with evaluations, how
    many were pooled into the final score."""
    steps, values = curve(run, metric)
    total_steps = run.config.get("total_steps")
    budget = budget if budget is not None else total_steps
    last_step = float(run.train["step"].max())
    if budget and met_stop_target(run):  # complete where its evaluations met the target: read it there
        budget = min(budget, last_step)
    peer = measures.peer_figure(run.train, budget, reference) if budget else None
    measure = measures.measure_of(reference) if reference is not None else "train_last_100"
    wall = float(run.train["time_s"].max()) if "time_s" in run.train and run.train["time_s"].notna().any() else np.nan
    reached = np.nonzero(values >= target)[0] if target is not None and len(values) else []
    pooled, episodes = final_pool(run) if metric == "eval" else (0, 0)
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
        peer_measure=measure,
        peer_iteration_steps=float(reference["iteration_steps"]) if measure == "train_iteration" else np.nan,
        peer_other_settings=(measures.other_settings(reference, [run.config]) or "") if reference else "",
        final_pooled=pooled,
        final_episodes=episodes,
        steps=last_step,
        wall_s=wall,
        sps=last_step / wall if wall and wall > 0 else np.nan,
    )


def final_pool(run: Run) -> tuple[int, int]:
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
        row["peer_measure"] = part["peer_measure"].iloc[0]  # one peer reference per task
        row["peer_iteration_steps"] = float(part["peer_iteration_steps"].iloc[0])
        reached = part["steps_to_target"].dropna()
        others = part[part["steps_to_target"].isna()]["best"].dropna()
        row.update(
            reached=len(reached),
            steps_to_target=float(reached.median()) if len(reached) else np.nan,
            others_best=";".join(formatting.number(v) for v in sorted(others)),  # what the seeds short of it reached
            wall_s=float(part["wall_s"].mean()),
            sps=float(part["sps"].mean()),
        )
        rows.append(row)
    rows.sort(key=lambda r: (runs.natural_key(r["task"]), runs.natural_key(r["setting"])))
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
            left_out.append(f"{task} ({why_not_normalised(baseline)})")
            continue
        why_not = baseline.why_not_comparable(reference, task)
        if why_not is not None:
            left_out.append(f"{task} ({reference['name']}: {why_not}; not comparable)")
            continue
        column = "peer" if measures.measure_of(reference) in measures.FROM_TRAINING else "final"
        if column == "peer":  # runs on another env protocol than the reference's are left out, with why
            other = part["peer_other_settings"].fillna("").astype(str)
            for setting, reasons in other[other.ne("")].groupby(part["setting"], sort=False):
                left_out.append(
                    f"{task} {setting} ({len(reasons)} run{'s' * (len(reasons) != 1)}; {reference['name']}: "
                    f"{reasons.iloc[0]}; not comparable)"
                )
            part = part[other.eq("")]
            if part.empty:
                continue
        if column == "peer" and not (part["peer"].notna() & (part["peer_budget"] == reference["steps"])).all():
            short = int((part["peer"].isna() | (part["peer_budget"] != reference["steps"])).sum())
            left_out.append(
                f"{task} ({short} of {len(part)} runs short of {reference['name']}'s budget, "
                f"{formatting.steps(reference['steps'])} steps: not comparable)"
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


def aggregate_table(normalised: dict, reps: int, seed: int, confidence: float = scores.CONFIDENCE) -> pd.DataFrame:
    rows = []
    for setting in sorted(normalised, key=runs.natural_key):
        table = normalised[setting]
        row = dict(setting=setting, tasks=len(table), runs=sum(len(v) for v in table.values()))
        for name, interval in scores.aggregate_intervals(table, reps, confidence, seed).items():
            row.update({name: interval.point, f"{name}_low": interval.low, f"{name}_high": interval.high})
        rows.append(row)
    return pd.DataFrame(rows)
