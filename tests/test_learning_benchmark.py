"""benchmarks/learning.py: a task is a Hydra multirun of the default command (backends x seeds,
any launcher) read back by the report, with the task's target."""

from __future__ import annotations

import pytest

from helpers import import_benchmark


@pytest.fixture
def learning(monkeypatch):
    return import_benchmark(monkeypatch, "learning")


def test_a_task_is_one_multirun_of_backends_and_seeds(learning, tmp_path):
    command = learning.multirun_command(
        learning.TASKS["doorkey8"], ["mono", "poly"], [1, 2, 3], tmp_path, "submitit_local", ["batch_size=16"]
    )
    assert command[1:4] == ["-m", "torchbeast_hydra", "-m"]
    assert "experiment=minigrid" in command
    assert {"backend=mono,poly", "seed=1,2,3", f"hydra.sweep.dir={tmp_path}", "hydra/launcher=submitit_local"} <= set(
        command
    )
    assert command[-1] == "batch_size=16"  # the user's overrides last: they win


def test_from_runs_reports_with_the_tasks_target(learning, tmp_path, monkeypatch):
    from test_report import write_job

    for seed in (1, 2):  # two CartPole runs whose evaluations pass 475 at 2,000 and 3,000 steps
        write_job(
            tmp_path / "sweep" / str(seed), "cartpole", "CartPole-v1", seed, [100.0, 480.0 if seed == 1 else 400, 500]
        )
    assert learning.main(["cartpole", "--from-runs", str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    # Two seeds: their range, not an interval; the peers' measure needs 500k steps; median steps to the target.
    row = "| all runs | 2 | 500.0 (range 500.0 to 500.0) | 500.0 (range 500.0 to 500.0) | - (0/2 seeds reached"
    assert row in text and "budget) | 2,500 (2/2 seeds) |" in text


def test_a_task_may_give_each_env_its_own_target(learning, tmp_path):
    from test_report import write_job

    write_job(tmp_path / "sweep" / "h", "control", "Hopper-v5", 1, [1000.0, 2400.0, 2500.0])
    write_job(tmp_path / "sweep" / "c", "control", "HalfCheetah-v5", 1, [1000.0, 1450.0, 1500.0])
    assert learning.TASKS["mujoco"].targets["Hopper-v5"] == 2383.0
    assert learning.main(["mujoco", "--from-runs", str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "steps to 2383" in text and "steps to 1443" in text  # each task's own target, in its own table
