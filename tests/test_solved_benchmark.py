"""benchmarks/solved.py: a run passes when an evaluation reaches its task's solved level and none
after it falls below the floor (0.9 of a positive level; a negative level over 0.9)."""

from __future__ import annotations

import pytest

from helpers import import_benchmark, write_run


@pytest.fixture
def solved(monkeypatch):
    return import_benchmark(monkeypatch, "solved")


def run_with_evaluations(path, task, seed, returns):
    write_run(path, [f"seed={seed}"], seed, [(160, [10.0], 1.0)], config=dict(env=dict(id=task)))
    lines = ["step,mean_return"] + [f"{50_000 * (i + 1)},{score}" for i, score in enumerate(returns)]
    (path / "eval.csv").write_text("\n".join(lines) + "\n")


def test_a_run_passes_only_if_it_reaches_the_level_and_stays_above_the_floor(solved, tmp_path, capsys):
    run_with_evaluations(tmp_path / "c1", "CartPole-v1", 1, [200, 480, 430, 500])  # 430 >= 427.5
    run_with_evaluations(tmp_path / "c2", "CartPole-v1", 2, [500, 500, 317, 500])  # a dip after solving
    run_with_evaluations(tmp_path / "c3", "CartPole-v1", 3, [300, 474.9])  # never solved
    run_with_evaluations(tmp_path / "a1", "Acrobot-v1", 1, [-500, -99, -111])  # the floor is -111.1
    run_with_evaluations(tmp_path / "a2", "Acrobot-v1", 2, [-500, -100, -112])
    found = {v.run: v for v in solved.verdicts([tmp_path], solved.solved_levels(), 0.9)}
    assert {name: v.passed for name, v in found.items()} == dict(c1=True, c2=False, c3=False, a1=True, a2=False)
    assert (found["c2"].solved_at, found["c2"].lowest_after) == (50_000, 317)
    assert found["c3"].solved_at is None and found["a1"].solved_at == 100_000
    solved.main([str(tmp_path)])
    printed = capsys.readouterr().out
    assert "CartPole-v1: 1/3 runs reach 475 and stay at or above 427.5" in printed
    assert "Acrobot-v1: 1/2 runs reach -100 and stay at or above -111.1" in printed


def test_levels_of_ones_own(solved, tmp_path, capsys):
    run_with_evaluations(tmp_path / "l1", "LunarLander-v3", 1, [100, 210, 190])
    solved.main([str(tmp_path), "--level", "LunarLander-v3=200"])
    assert "LunarLander-v3: 1/1 runs reach 200 and stay at or above 180.0" in capsys.readouterr().out
