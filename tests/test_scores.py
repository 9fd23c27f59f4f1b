"""Aggregate scores and their stratified bootstrap intervals: hand-computed values, scipy, and rliable."""

import numpy as np
import pytest
import scipy.stats

from torchbeast_hydra.analysis import scores


def load_rliable():
    """rliable's library and metrics modules, or a skip saying why not.

    rliable 1.2.0 pins arch<8, and arch 7.x's import fails on pandas 3: a plotting method of its
    univariate models is decorated with pandas' private deprecate_kwarg, whose signature pandas 3
    changed. The bootstrap rliable uses never touches that method, so for the import only that
    decorator is made a no-op when called the old way.
    """
    pytest.importorskip("rliable")
    import pandas.util._decorators as decorators

    original = decorators.deprecate_kwarg

    def old_or_new(*args, **kwargs):
        if len(args) == 2 and all(isinstance(a, str) for a in args) and not kwargs:
            return lambda function: function  # arch's deprecate_kwarg("type", "plot_type")
        return original(*args, **kwargs)

    decorators.deprecate_kwarg = old_or_new
    try:
        from rliable import library, metrics
    except Exception as error:  # whatever stops the import, the comparison is skipped
        pytest.skip(f"rliable does not import here: {error!r}")
    finally:
        decorators.deprecate_kwarg = original
    return library, metrics


# Hand-computed values.


def test_iqm_is_the_mean_of_the_middle_half_of_all_runs():
    assert scores.iqm({"a": np.arange(1, 9)}) == 4.5  # (3 + 4 + 5 + 6) / 4
    # Pooled across tasks: 1..8 split into two tasks gives the same.
    assert scores.iqm({"a": [1, 5, 8, 2], "b": [7, 3, 6, 4]}) == 4.5
    # int(10 / 4) = 2 cut at each end, as scipy.stats.trim_mean: (3 + ... + 8) / 6.
    assert scores.iqm({"a": np.arange(1, 11)}) == 5.5
    # An outlier moves the mean, not the IQM.
    assert scores.iqm({"a": [1, 2, 3, 1000]}) == 2.5


def test_iqm_matches_scipy_trim_mean_on_random_scores():
    rng = np.random.default_rng(0)
    for runs in (1, 2, 3, 5, 7, 10):
        table = {f"t{i}": rng.normal(size=runs) for i in range(rng.integers(1, 6))}
        pooled = np.concatenate(list(table.values()))
        assert scores.iqm(table) == pytest.approx(scipy.stats.trim_mean(pooled, 0.25), abs=1e-12)


def test_median_and_mean_are_over_per_task_means():
    table = {"a": [0.0, 2.0], "b": [10.0], "c": [4.0, 4.0, 7.0]}  # task means 1, 10, 5
    assert scores.median(table) == 5.0
    assert scores.mean(table) == pytest.approx(16 / 3)


def test_optimality_gap_counts_only_the_shortfall_below_gamma():
    table = {"a": [0.5, 1.5], "b": [1.0, 0.0]}  # a: (0.5 + 0) / 2, b: (0 + 1) / 2
    assert scores.optimality_gap(table) == 0.375
    assert scores.optimality_gap({"a": [3.0, 5.0]}) == 0.0  # above the reference everywhere
    assert scores.optimality_gap({"a": [0.5]}, gamma=2.0) == 1.5


def test_normalise_maps_random_to_0_and_the_reference_to_1():
    assert scores.normalise([-20.7, 14.6, -3.05], random=-20.7, reference=14.6).tolist() == pytest.approx([0, 1, 0.5])
    with pytest.raises(ValueError, match="equal to the random score"):
        scores.normalise([1.0], random=2.0, reference=2.0)


def test_tasks_without_runs_or_with_nan_scores_are_refused():
    with pytest.raises(ValueError, match="no tasks"):
        scores.iqm({})
    with pytest.raises(ValueError, match="'b' has no runs"):
        scores.mean({"a": [1.0], "b": []})
    with pytest.raises(ValueError, match="'a' has a NaN"):
        scores.mean({"a": [1.0, float("nan")]})


def test_performance_profile_is_the_fraction_of_runs_above_each_tau():
    profile = scores.performance_profile({"a": [0.0, 1.0], "b": [2.0]}, taus=[-1.0, 0.5, 1.0, 3.0], reps=50)
    # a: 1, 1/2, 0, 0; b: 1, 1, 1, 0; each task weighs the same.
    assert profile.fraction.tolist() == [1.0, 0.75, 0.5, 0.0]
    assert (profile.low <= profile.fraction).all() and (profile.fraction <= profile.high).all()


# The bootstrap.


def test_the_bootstrap_resamples_runs_within_each_task():
    # A task with one run always contributes that run; resampling across tasks would not.
    table = {"one": [5.0], "three": [0.0, 1.0, 2.0]}
    samples = scores.stratified_resamples(table, reps=500, seed=1)
    assert samples[0].shape == (500, 1) and (samples[0] == 5.0).all()
    assert samples[1].shape == (500, 3) and set(np.unique(samples[1])) == {0.0, 1.0, 2.0}
    interval = scores.bootstrap_interval(table, scores.AGGREGATES["mean"], reps=500)
    assert interval.point == 3.0 and 2.5 <= interval.low < 3.0 < interval.high <= 3.5


def test_intervals_are_reproducible_by_seed_and_narrow_with_more_runs():
    rng = np.random.default_rng(3)
    few = {f"t{i}": rng.normal(0.5, 0.3, size=3) for i in range(4)}
    many = {f"t{i}": rng.normal(0.5, 0.3, size=30) for i in range(4)}
    first, again = scores.aggregate_intervals(few, seed=7), scores.aggregate_intervals(few, seed=7)
    assert first == again
    assert scores.aggregate_intervals(few, seed=8) != first
    for name in scores.AGGREGATES:
        low, high = first[name].low, first[name].high
        assert low <= first[name].point <= high
        many_width = scores.aggregate_intervals(many)[name].high - scores.aggregate_intervals(many)[name].low
        assert many_width < high - low, name


def test_constant_runs_give_a_zero_width_interval():
    interval = scores.aggregate_intervals({"a": [0.4, 0.4], "b": [0.8, 0.8, 0.8]})
    assert interval["mean"] == (pytest.approx(0.6), pytest.approx(0.6), pytest.approx(0.6))


def test_mean_band_is_the_mean_over_runs_point_by_point_ignoring_missing_points():
    runs = [[1.0, 2.0, 3.0], [3.0, 4.0, np.nan]]  # the second run stopped before the last point
    mean, low, high = scores.mean_band(runs, reps=200)
    assert mean.tolist() == [2.0, 3.0, 3.0]
    assert low[2] == high[2] == 3.0  # only one run there: no spread
    assert 1.0 <= low[0] <= 2.0 <= high[0] <= 3.0
    single_mean, single_low, single_high = scores.mean_band([[1.0, 2.0]])
    assert single_mean.tolist() == single_low.tolist() == single_high.tolist() == [1.0, 2.0]


# Against rliable itself.

RLIABLE_REPS = 10_000
PROFILE_REPS = 5_000  # rliable's profiles call the function per tau per replicate: slower


def rliable_aggregates(metrics):
    return lambda x: np.array(
        [
            metrics.aggregate_iqm(x),
            metrics.aggregate_median(x),
            metrics.aggregate_mean(x),
            metrics.aggregate_optimality_gap(x),
        ]
    )


def score_matrices():
    """[runs, tasks] matrices as rliable takes them: skewed, with outliers, above and below 1."""
    rng = np.random.default_rng(2021)
    yield rng.normal(0.7, 0.5, size=(5, 4))
    yield rng.lognormal(0.0, 1.0, size=(3, 7))
    yield np.concatenate([rng.uniform(0, 2, size=(9, 3)), [[10.0, -3.0, 0.5]]])


def test_point_estimates_equal_rliables():
    _, metrics = load_rliable()
    for matrix in score_matrices():
        table = {f"task{i}": matrix[:, i] for i in range(matrix.shape[1])}
        assert scores.iqm(table) == pytest.approx(metrics.aggregate_iqm(matrix), rel=1e-12)
        assert scores.median(table) == pytest.approx(metrics.aggregate_median(matrix), rel=1e-12)
        assert scores.mean(table) == pytest.approx(metrics.aggregate_mean(matrix), rel=1e-12)
        assert scores.optimality_gap(table) == pytest.approx(metrics.aggregate_optimality_gap(matrix), rel=1e-12)


def test_intervals_agree_with_rliables_stratified_bootstrap():
    library, metrics = load_rliable()
    for matrix in score_matrices():
        table = {f"task{i}": matrix[:, i] for i in range(matrix.shape[1])}
        ours = scores.aggregate_intervals(table, reps=RLIABLE_REPS, seed=0)
        np.random.seed(0)  # rliable's StratifiedBootstrap draws from numpy's global generator
        points, intervals = library.get_interval_estimates(
            {"x": matrix}, rliable_aggregates(metrics), reps=RLIABLE_REPS
        )
        for i, name in enumerate(scores.AGGREGATES):
            low, high = intervals["x"][:, i]
            assert ours[name].point == pytest.approx(points["x"][i], rel=1e-12)
            # Two independent sets of replicates: the ends agree to within Monte Carlo error.
            tolerance = 0.06 * (high - low) + 1e-9
            assert ours[name].low == pytest.approx(low, abs=tolerance), name
            assert ours[name].high == pytest.approx(high, abs=tolerance), name


def test_performance_profile_agrees_with_rliables():
    library, _ = load_rliable()
    for matrix in score_matrices():
        table = {f"task{i}": matrix[:, i] for i in range(matrix.shape[1])}
        taus = scores.tau_grid(table, points=21)
        ours = scores.performance_profile(table, taus, reps=PROFILE_REPS)
        np.random.seed(0)
        profiles, bands = library.create_performance_profile({"x": matrix}, taus, reps=PROFILE_REPS)
        assert ours.fraction == pytest.approx(profiles["x"], abs=1e-12)
        # A fraction of n runs moves in steps of 1 / n: the band's ends agree to within one step.
        step = 1 / matrix.size
        assert ours.low == pytest.approx(bands["x"][0], abs=step + 1e-9)
        assert ours.high == pytest.approx(bands["x"][1], abs=step + 1e-9)
