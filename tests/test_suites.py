"""A benchmark suite is a Hydra multirun (experiment=suite_*): tasks x seeds through any launcher,
each job in a dir named by its overrides, and the report reads the sweep back."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from torchbeast_hydra.analysis import report
from torchbeast_hydra.logs.metrics import read_rows

from helpers import SMALL, run_sweep

pytestmark = pytest.mark.slow


def entry(random: float, goal: float) -> dict:
    """A baselines.yaml entry: normalised scores are 0 at `random` and 1 at `goal`."""
    references = [dict(name="goal", score=goal, source="test", measure="bound")]  # a bound: any budget
    return dict(random=dict(score=random, source="test"), normalise_by="goal", references=references)


def test_a_two_task_two_seed_suite_runs_resumes_and_reports(tmp_path):
    sweep = tmp_path / "suite"
    # The suite's own tasks (CartPole-v1, Acrobot-v1), two of its seeds, a few updates each.
    command = [
        "experiment=suite_classic",
        "seed=1,2",
        "total_steps=640",
        "eval.episodes=2",
        *SMALL,
        "backend.num_actors=1",
    ]
    result = run_sweep(sweep, *command, timeout=600)
    assert result.returncode == 0, result.stderr
    jobs = sorted(p.name for p in sweep.iterdir() if (p / "logs.csv").exists())
    assert jobs == sorted(f"seed={seed},task={task}" for task in ("Acrobot-v1", "CartPole-v1") for seed in (1, 2))
    for job in jobs:
        assert read_rows(sweep / job / "eval.csv")[-1]["final"] is True  # each job evaluated at its end
    # Each run's saved config holds its task's own settings (conf/task/).
    for task, learning_rate in (("CartPole-v1", 0.001), ("Acrobot-v1", 0.003)):
        saved = yaml.safe_load((sweep / f"seed=1,task={task}" / ".hydra" / "config.yaml").read_text())
        assert (saved["env"]["id"], saved["optim"]["learning_rate"]) == (task, learning_rate)

    # The same command again: every job resumes at its end (its checkpoint), nothing is trained twice.
    again = run_sweep(sweep, *command, timeout=600)
    assert again.returncode == 0, again.stderr
    assert all(len(read_rows(sweep / job / "eval.csv")) == 1 for job in jobs)

    # Normalised by a data file of the reader's (its own goals, whatever the packaged baselines say).
    baselines = tmp_path / "baselines.yaml"
    baselines.write_text(yaml.safe_dump({"CartPole-v1": entry(0.0, 500.0), "Acrobot-v1": entry(-500.0, -100.0)}))
    written = report.write_report([sweep], tmp_path / "report", report.Options(baselines=baselines, reps=200))
    tasks = pd.read_csv(written["tasks_csv"]).set_index("task")
    assert set(tasks.index) == {"CartPole-v1", "Acrobot-v1"} and set(tasks["seeds"]) == {2}
    finals = {job: read_rows(sweep / job / "eval.csv")[-1]["mean_return"] for job in jobs}
    cartpole = [finals[f"seed={s},task=CartPole-v1"] for s in (1, 2)]
    assert tasks.loc["CartPole-v1", "final"] == pytest.approx(sum(cartpole) / 2)
    (aggregate,) = pd.read_csv(written["aggregates_csv"]).to_dict("records")
    normalised = [r / 500 for r in cartpole] + [(finals[f"seed={s},task=Acrobot-v1"] + 500) / 400 for s in (1, 2)]
    assert aggregate["tasks"] == 2 and aggregate["mean"] == pytest.approx(sum(normalised) / 4)
    assert (tmp_path / "report" / "report.md").exists()
