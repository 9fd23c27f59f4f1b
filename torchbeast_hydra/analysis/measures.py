"""How a figure was measured, and our runs measured the same way, so that the report sets like against like.

A published reference (baselines.yaml) names its measure, the env it was measured on and its
budget. Our runs give two figures: our evaluation (eval.csv) and the peer's own, read from the
training episodes (sampled actions) as the peer read its: the mean of the last 100 at the budget
(`last_episodes_mean`, CleanRL's), or the mean of those that ended within the last iteration
before it (`iteration_mean`, Dopamine's per-iteration training return). A reference is compared
with runs only where the measure, the env and the env settings it names match (`why_not_comparable`).

Few seeds are said to be few (`spread`): under MIN_SEEDS_FOR_INTERVAL seeds a percentile bootstrap
"95%" interval of the mean is little more than the seed range (with 3 seeds it covers ~75%), so
the range itself is given, named as such.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import pandas as pd

from torchbeast_hydra.analysis import scores

# A reference's measure (baselines.yaml's `measure`) -> what it is, as the report words it.
MEASURES = {
    "train_last_100": "the mean of the last 100 training episodes (sampled actions) at the budget, per run",
    "train_iteration": "the mean of the training episodes (the training policy's own play: epsilon-greedy "
    "at 0.01 for Dopamine's agents, sampled for ours) that ended within the last iteration before the budget, per run",
    "bound": "a bound of the task (its maximum, or the level at which it counts as solved)",
    "human": "a human's score",
    "other": "measured otherwise",
}
ANCHORS = ("bound", "human")  # not runs of an algorithm: they compare with any measure of ours
FROM_TRAINING = ("train_last_100", "train_iteration")  # measures our runs' training episodes give
PEER_WINDOW = 100
MIN_SEEDS_FOR_INTERVAL = 5


class PeerFigure(NamedTuple):
    """A run's mean of its last episodes at a budget: the value, the step of the update it was read
    at (the first at or past the budget), and how many episodes it averages."""

    value: float
    step: int
    episodes: int


def last_episodes_mean(train: pd.DataFrame, budget: float, window: int = PEER_WINDOW) -> Optional[PeerFigure]:
    """The mean return of the last `window` training episodes that ended by the first update at or
    past `budget` agent steps (an update ends at most one batch past it), from logs.csv's
    per-episode returns; None if the run never reached the budget or had no episode by then."""
    rows = train.sort_values("step", kind="stable")
    at = np.flatnonzero(rows["step"].to_numpy(float) >= budget)
    if not len(at):
        return None
    upto = rows.iloc[: at[0] + 1]
    returns = [float(r) for episode_returns in upto["episode_returns"] for r in episode_returns]
    if not returns:
        return None
    last = returns[-window:]
    return PeerFigure(float(np.mean(last)), int(upto["step"].iloc[-1]), len(last))


def iteration_mean(train: pd.DataFrame, budget: float, iteration_steps: float) -> Optional[PeerFigure]:
    """The mean return of the training episodes that ended within the last `iteration_steps` agent
    steps before `budget` (Dopamine's per-iteration training return: iteration 9 of 250,000 agent
    steps ends at 2,500,000), from logs.csv's rows: those after budget - iteration_steps, up to the
    first update at or past the budget (a row's episodes ended since the row before it). None if
    the run never reached the budget or no episode ended in the window."""
    rows = train.sort_values("step", kind="stable")
    steps = rows["step"].to_numpy(float)
    at = np.flatnonzero(steps >= budget)
    if not len(at):
        return None
    window = rows.iloc[: at[0] + 1][steps[: at[0] + 1] > budget - iteration_steps]
    returns = [float(r) for episode_returns in window["episode_returns"] for r in episode_returns]
    if not returns:
        return None
    return PeerFigure(float(np.mean(returns)), int(steps[at[0]]), len(returns))


def peer_figure(train: pd.DataFrame, budget: float, reference: Optional[dict] = None) -> Optional[PeerFigure]:
    """A run's figure on the reference's measure at budget: the training episodes read as the
    reference read its (train_iteration: its `iteration_steps`), else the last 100 (CleanRL's)."""
    if reference is not None and measure_of(reference) == "train_iteration":
        return iteration_mean(train, budget, float(reference["iteration_steps"]))
    return last_episodes_mean(train, budget)


def measure_of(reference: dict) -> str:
    """A reference's measure; `other` when baselines.yaml does not say (never compared)."""
    measure = reference.get("measure", "other")
    if measure not in MEASURES:
        raise ValueError(
            f"baselines.yaml: {reference.get('name')!r} has measure {measure!r}; use one of {list(MEASURES)}"
        )
    return measure


def why_not_comparable(reference: dict, task: str, same_dynamics=(), configs=()) -> Optional[str]:
    """None when runs on `task` compare with the reference: an anchor (a bound, a human score), or
    measured as our runs can be (FROM_TRAINING) on the same env or one with the same dynamics, and
    each of the runs' `configs` (flattened, runs.read_config) has the env settings the reference
    names (`env_settings`: ALE/Breakout-v5 with or without sticky actions is another protocol under
    one id). Otherwise why not, in words."""
    measure = measure_of(reference)
    if measure in ANCHORS:
        return None
    if measure == "other":
        return f"measured otherwise ({reference.get('how') or 'see its source'})"
    env = reference.get("env") or task
    if env != task and not (env in same_dynamics and task in same_dynamics):
        return f"measured on {env}, these runs are on {task} (another version: rewards or dynamics differ)"
    return other_settings(reference, configs)


def other_settings(reference: dict, configs) -> Optional[str]:
    """Which env settings the reference names that some of the runs (flattened configs) do not have,
    in words (a run that does not record one counts as not having it); None if all have them."""
    configs = list(configs)
    differ = []
    for key, wanted in (reference.get("env_settings") or {}).items():
        found = [config.get(f"env.{key}", "not recorded") for config in configs]
        off = [value for value in found if value != wanted]
        if off:
            values = ", ".join(dict.fromkeys(str(value) for value in off))
            count = f" in {len(off)} of {len(found)} runs" if len(found) > 1 else ""
            differ.append(f"env.{key}={values}{count}, the reference's {wanted}")
    if not differ:
        return None
    return f"another env protocol ({'; '.join(differ)})"


class Spread(NamedTuple):
    """The mean over seeds and its spread: a percentile bootstrap interval (`kind` "95% interval")
    with MIN_SEEDS_FOR_INTERVAL seeds or more, else the seeds' range ("range"); "one seed": none."""

    point: float
    low: float
    high: float
    kind: str


def spread(values, reps: int, seed: int, confidence: float = scores.CONFIDENCE) -> Spread:
    values = np.asarray([v for v in values if not np.isnan(v)], dtype=float)
    if not len(values):
        return Spread(np.nan, np.nan, np.nan, "")
    if len(values) == 1:
        return Spread(float(values[0]), float(values[0]), float(values[0]), "one seed")
    if len(values) < MIN_SEEDS_FOR_INTERVAL:
        return Spread(float(values.mean()), float(values.min()), float(values.max()), "range")
    interval = scores.bootstrap_interval({"runs": values}, scores.AGGREGATES["mean"], reps, confidence, seed)
    return Spread(*interval, f"{confidence:.0%} interval")
