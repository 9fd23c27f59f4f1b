"""Scores across tasks and runs: normalisation, aggregates and stratified bootstrap intervals.

The statistics of Agarwal et al., "Deep Reinforcement Learning at the Edge of the Statistical
Precipice" (NeurIPS 2021), as their library rliable defines them, in plain numpy:

    scores = {"HalfCheetah-v5": [0.8, 1.1, 0.9], "Hopper-v5": [0.4, 0.7]}   # task -> one score per run
    aggregate_intervals(scores)        # {"IQM": Interval(point, low, high), "median": ..., ...}
    performance_profile(scores, taus)  # fraction of runs above each tau, with its band

Tasks may have different numbers of runs (seeds): the bootstrap resamples each task's runs on their
own (stratified), so a task never borrows another's runs. With equal run counts every point
estimate equals rliable's (tests/test_scores.py checks it against rliable itself). With unequal
counts, each task weighs the same in the mean, median, optimality gap and profile (the mean of
per-task figures); the IQM pools all runs, as rliable's does, since trimming needs one pool.
"""

from __future__ import annotations

import warnings
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

DEFAULT_REPS = 2_000  # rliable's default for profiles; its intervals default to 50,000, slower for little change
CONFIDENCE = 0.95
GAMMA = 1.0  # the optimality gap's threshold: the normalised score of the reference


class Interval(NamedTuple):
    point: float
    low: float
    high: float


class Profile(NamedTuple):
    taus: np.ndarray
    fraction: np.ndarray  # of runs with a score above each tau (each task weighing the same)
    low: np.ndarray
    high: np.ndarray


# A statistic takes the tasks' runs, each an array whose last axis is the runs (leading axes are
# bootstrap replicates), and returns one value per replicate.
Parts = Sequence[np.ndarray]
Statistic = Callable[[Parts], np.ndarray]


def normalise(scores, random: float, reference: float) -> np.ndarray:
    """(score - random) / (reference - random): 0 is random play, 1 the reference's score."""
    if reference == random:
        raise ValueError(f"a reference score equal to the random score ({random}) normalises nothing")
    return (np.asarray(scores, dtype=float) - random) / (reference - random)


def iqm(scores) -> float:
    """Interquartile mean: the mean of the middle 50% of all runs' scores, all tasks pooled (the
    25% trimmed mean: int(n / 4) scores cut at each end, as scipy.stats.trim_mean)."""
    return _value(_iqm(_parts(scores)))


def median(scores) -> float:
    """The median over tasks of each task's mean score."""
    return _value(_median(_parts(scores)))


def mean(scores) -> float:
    """The mean over tasks of each task's mean score."""
    return _value(_mean(_parts(scores)))


def optimality_gap(scores, gamma: float = GAMMA) -> float:
    """How far below gamma the runs fall on average: the mean over tasks of mean(max(0, gamma - score)).
    Scores above gamma count as gamma, so beating the reference on one task hides no shortfall on
    another."""
    return _value(_optimality_gap(_parts(scores), gamma))


def _iqm(parts: Parts) -> np.ndarray:
    pooled = np.sort(np.concatenate(parts, axis=-1), axis=-1)
    n = pooled.shape[-1]
    cut = int(0.25 * n)
    return pooled[..., cut : n - cut].mean(axis=-1)


def _task_means(parts: Parts) -> np.ndarray:
    return np.stack([part.mean(axis=-1) for part in parts], axis=-1)


def _median(parts: Parts) -> np.ndarray:
    return np.median(_task_means(parts), axis=-1)


def _mean(parts: Parts) -> np.ndarray:
    return _task_means(parts).mean(axis=-1)


def _optimality_gap(parts: Parts, gamma: float = GAMMA) -> np.ndarray:
    return np.stack([np.maximum(0.0, gamma - part).mean(axis=-1) for part in parts], axis=-1).mean(axis=-1)


# The aggregates a report shows, in its order; each maps the tasks' runs to one value per replicate.
AGGREGATES: dict[str, Statistic] = {
    "IQM": _iqm,
    "median": _median,
    "mean": _mean,
    "optimality gap": _optimality_gap,
}


def stratified_resamples(scores, reps: int = DEFAULT_REPS, seed: Optional[int] = 0) -> list:
    """reps bootstrap replicates of every task's runs: each task's n runs drawn n times with
    replacement from its own runs. Returns one [reps, n] array per task."""
    rng = np.random.default_rng(seed)
    return [part[rng.integers(0, part.shape[-1], size=(reps, part.shape[-1]))] for part in _parts(scores)]


def bootstrap_interval(
    scores,
    statistic: Statistic,
    reps: int = DEFAULT_REPS,
    confidence: float = CONFIDENCE,
    seed: Optional[int] = 0,
) -> Interval:
    """The statistic on the scores, and its percentile interval over stratified bootstrap replicates
    (rliable's default method: the replicates' (1 - confidence) / 2 and (1 + confidence) / 2 quantiles)."""
    point = _value(statistic(_parts(scores)))
    low, high = _percentiles(statistic(stratified_resamples(scores, reps, seed)), confidence)
    return Interval(point, float(low), float(high))


def aggregate_intervals(
    scores, reps: int = DEFAULT_REPS, confidence: float = CONFIDENCE, seed: Optional[int] = 0
) -> dict:
    """{name: Interval} for IQM, median, mean and optimality gap, all from the same replicates."""
    samples = stratified_resamples(scores, reps, seed)
    parts = _parts(scores)
    out = {}
    for name, statistic in AGGREGATES.items():
        low, high = _percentiles(statistic(samples), confidence)
        out[name] = Interval(_value(statistic(parts)), float(low), float(high))
    return out


def performance_profile(
    scores,
    taus: Sequence[float],
    reps: int = DEFAULT_REPS,
    confidence: float = CONFIDENCE,
    seed: Optional[int] = 0,
) -> Profile:
    """The score distribution: for each tau, the fraction of runs with a score above tau (rliable's
    run-score profile), each task weighing the same, with a stratified bootstrap band."""
    taus = np.asarray(taus, dtype=float)

    def fractions(parts: Parts) -> np.ndarray:
        # [..., runs, 1] > [taus] -> [..., runs, taus] -> mean over runs, then over tasks
        return np.stack([(part[..., None] > taus).mean(axis=-2) for part in parts], axis=-1).mean(axis=-1)

    low, high = _percentiles(fractions(stratified_resamples(scores, reps, seed)), confidence)
    return Profile(taus, fractions(_parts(scores)), low, high)


def tau_grid(scores, points: int = 101) -> np.ndarray:
    """Thresholds for a profile of normalised scores: from min(0, lowest) to max(1, highest)."""
    pooled = np.concatenate(_parts(scores))
    return np.linspace(min(0.0, float(pooled.min())), max(1.0, float(pooled.max())), points)


def mean_band(runs, reps: int = DEFAULT_REPS, confidence: float = CONFIDENCE, seed: Optional[int] = 0) -> tuple:
    """A curve's mean over runs and its bootstrap band, point by point.

    runs: [runs, points], NaN where a run has no value (e.g. it stopped earlier). Runs are resampled
    whole, so each replicate is a set of real curves. Returns (mean, low, high), each [points].
    """
    runs = np.asarray(runs, dtype=float)
    if runs.ndim != 2 or runs.shape[0] == 0:
        raise ValueError(f"expected [runs, points] with at least one run, got shape {runs.shape}")
    rng = np.random.default_rng(seed)
    samples = runs[rng.integers(0, runs.shape[0], size=(reps, runs.shape[0]))]  # [reps, runs, points]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a point no run reaches is NaN; the warning adds nothing
        means = np.nanmean(samples, axis=1)
        alpha = 100 * (1 - confidence) / 2
        low, high = np.nanpercentile(means, [alpha, 100 - alpha], axis=0)
        return np.nanmean(runs, axis=0), low, high


def _parts(scores) -> list:
    """The tasks' runs as float arrays (runs on the last axis), checked: none empty, none NaN."""
    values = list(scores.values()) if isinstance(scores, Mapping) else list(scores)
    if not values:
        raise ValueError("no tasks to aggregate")
    parts = [np.asarray(v, dtype=float) for v in values]
    names = list(scores) if isinstance(scores, Mapping) else list(range(len(parts)))
    for name, part in zip(names, parts):
        if part.ndim == 0 or part.shape[-1] == 0:
            raise ValueError(f"task {name!r} has no runs")
        if np.isnan(part).any():
            raise ValueError(f"task {name!r} has a NaN score: leave out runs that have none")
    return parts


def _percentiles(replicates: np.ndarray, confidence: float) -> np.ndarray:
    alpha = 100 * (1 - confidence) / 2
    return np.percentile(replicates, [alpha, 100 - alpha], axis=0)


def _value(result):
    result = np.asarray(result)
    return float(result) if result.ndim == 0 else result
