"""benchmarks/learning.py, reading runs back (--from-runs): the moving mean over whole games, the
steps to a target counted on full windows only, the table, and the curve with its dashed line."""

from __future__ import annotations

import pytest

from helpers import import_benchmark, write_run


@pytest.fixture
def learning(monkeypatch):
    return import_benchmark(monkeypatch, "learning")


def rows_of(returns_per_update):
    return [
        dict(step=(i + 1) * 1000, time_s=(i + 1) * 2.0, episode_returns=returns)
        for i, returns in enumerate(returns_per_update)
    ]


def test_the_target_counts_only_once_a_full_window_of_games_is_in(learning):
    # 99 games at 1.0 (a partial window), then one at 1.0 (full: mean 1.0), then 100 at 0.0.
    updates = [[1.0] * 99, [1.0], *[[0.0]] * 100]
    summary = learning.summarise(rows_of(updates), target=0.9)
    assert (summary["steps_to_target"], summary["minutes_to_target"]) == (2000, round(4.0 / 60, 1))
    assert (summary["best_mean"], summary["final_mean"], summary["games"]) == (1.0, 0.0, 200)
    assert (summary["steps"], summary["mean_sps"]) == (102_000, 500)


def test_a_target_never_reached_reads_as_none(learning):
    summary = learning.summarise(rows_of([[0.5] * 100, [0.6] * 50]), target=0.9)
    assert summary["steps_to_target"] is None and summary["minutes_to_target"] is None
    assert summary["final_mean"] == 0.55


def test_the_moving_mean_starts_after_ten_games_and_spans_the_last_hundred(learning):
    points = learning.moving_mean(rows_of([[1.0] * 9, [], [3.0], [5.0] * 100]))
    # No point before ten games, none for an update that ended no game.
    assert [(step, mean) for step, _, mean in points] == [(3000, 1.2), (4000, 5.0)]


@pytest.mark.parametrize("task, reference_in_legend", [("minigrid", False), ("nethack", True)])
def test_from_runs_writes_the_table_and_the_curve(learning, tmp_path, monkeypatch, capsys, task, reference_in_legend):
    # Returns near 50: NetHack's 971 is far above them, MiniGrid's 0.9 far below.
    updates = [(1000 * (i + 1), [40.0 + i % 20] * 5, 0.0) for i in range(40)]  # 2 s per update of 1,000 steps
    write_run(tmp_path / "a", [], 1, updates, config=dict(backend=dict(name="poly")), steps_per_s=500)
    drawn = {}
    monkeypatch.setattr(learning, "plot", lambda *args: drawn.update(args=args))
    monkeypatch.setattr("sys.argv", ["learning.py", task, "--from-runs", str(tmp_path / "a"), "--out", str(tmp_path)])
    learning.main()
    table = (tmp_path / "table.md").read_text()
    assert "| poly seed 1 |" in table and f"env={task}" in table
    curves, target, label = drawn["args"][:3]
    assert list(curves) == ["poly seed 1"] and target == learning.TASKS[task].target
    assert ("NLE" in label) == reference_in_legend


@pytest.mark.parametrize("target, lines", [(60.0, 2), (971.0, 0)])
def test_the_dashed_line_is_drawn_unless_it_would_flatten_the_curves(learning, tmp_path, monkeypatch, target, lines):
    saved = {}
    monkeypatch.setattr(learning.Figure, "savefig", lambda fig, path: saved.update(fig=fig))
    curves = {"poly seed 1": [(1000, 0.1, 40.0), (2000, 0.2, 55.0)]}
    learning.plot(curves, target, "a published figure", tmp_path / "curve.png", "title")
    by_steps, by_time = saved["fig"].axes
    dashed = [line for ax in (by_steps, by_time) for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == lines
    legend = [text.get_text() for text in saved["fig"].legends[0].get_texts()]
    assert any(f"a published figure: {target:g}" in entry for entry in legend)
