"""The report's numbers: each run's score curve and summary, per task and setting a table with
bootstrap intervals over seeds, and across tasks the normalised scores' aggregates (scores.py)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from torchbeast_hydra.analysis import runs, scores
from torchbeast_hydra.analysis.baselines import why_not_normalised
from torchbeast_hydra.analysis.runs import Run
from torchbeast_hydra.logs.metrics import target_met

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


def summarise(run: Run, metric: str, target: Optional[float]) -> dict:
    """Final and best score, the first step at or above target, training time and steps/s."""
    steps, values = curve(run, metric)
    wall = float(run.train["time_s"].max()) if "time_s" in run.train and run.train["time_s"].notna().any() else np.nan
    last_step = float(run.train["step"].max())
    reached = np.nonzero(values >= target)[0] if target is not None and len(values) else []
    total_steps = run.config.get("total_steps")
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
        steps=last_step,
        wall_s=wall,
        sps=last_step / wall if wall and wall > 0 else np.nan,
    )


# Tables.


def task_table(per_run: pd.DataFrame, reps: int, seed: int, confidence: float = scores.CONFIDENCE) -> pd.DataFrame:
    """Per task and setting: seeds, final and best score (mean over seeds and its bootstrap
    interval), steps to target (median over the seeds that reached it, and how many did),
    training time and steps/s (means over seeds)."""
    rows = []
    for (task, setting), part in per_run.groupby(["task", "setting"], sort=False):
        row = dict(task=task, setting=setting, seeds=len(part), unfinished=int(part["unfinished"].sum()))
        for column in ("final", "best"):
            values = part[column].dropna().to_numpy()
            interval = _mean_interval(values, reps, seed, confidence)
            row.update({column: interval.point, f"{column}_low": interval.low, f"{column}_high": interval.high})
        reached = part["steps_to_target"].dropna()
        row.update(
            reached=len(reached),
            steps_to_target=float(reached.median()) if len(reached) else np.nan,
            wall_s=float(part["wall_s"].mean()),
            sps=float(part["sps"].mean()),
        )
        rows.append(row)
    rows.sort(key=lambda r: (runs.natural_key(r["task"]), runs.natural_key(r["setting"])))
    return pd.DataFrame(rows)


def _mean_interval(values: np.ndarray, reps: int, seed: int, confidence: float) -> scores.Interval:
    if len(values) == 0:
        return scores.Interval(np.nan, np.nan, np.nan)
    return scores.bootstrap_interval({"runs": values}, scores.AGGREGATES["mean"], reps, confidence, seed)


def normalised_scores(per_run: pd.DataFrame, baselines: dict) -> tuple:
    """({setting: {task: normalised final scores}}, {task: Baseline used}, [tasks left out, with why])."""
    out, used, left_out = {}, {}, []
    for task, part in per_run.groupby("task", sort=False):
        baseline = baselines.get(task)
        reference = baseline.normaliser() if baseline else None
        if reference is None:
            left_out.append(f"{task} ({why_not_normalised(baseline)})")
            continue
        used[task] = baseline
        for setting, runs_of_setting in part.groupby("setting", sort=False):
            finals = runs_of_setting["final"].dropna().to_numpy()
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
