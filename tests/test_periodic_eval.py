"""Evaluation during training (evaluation/periodic.py): rows at the interval while training goes on,
on envs whose seeds no training env has, a final one, and the sweeper's objective read from them."""

from __future__ import annotations

import logging
import queue
import time
from types import SimpleNamespace

import pytest
import torch

from torchbeast_hydra.__main__ import final_return
from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.evaluation.evaluate import figures
from torchbeast_hydra.evaluation.periodic import Evaluations
from torchbeast_hydra.logs.metrics import CsvLog, RecentReturns, read_rows, target_met
from torchbeast_hydra.run.seeding import EVAL_SEED_BASE, actor_seed, eval_seed

from helpers import TINY, compose_config, run_cli


class Recorder:
    """A sink that keeps the evaluations it is sent (as wandb's and TensorBoard's do)."""

    def __init__(self):
        self.rows = []

    def log_eval(self, row):
        self.rows.append(row)


def evaluations(tmp_path, *overrides):
    cfg = compose_config(["experiment=cartpole", "eval.episodes=2", "test.max_episode_steps=50", *overrides])
    return cfg, Evaluations(cfg, tmp_path, [Recorder()], resume_step=0)


def weights_of(cfg):
    from torchbeast_hydra.env.spaces import probe_env

    model = make_model(cfg.model, probe_env(cfg.env))
    return lambda: {key: value.clone() for key, value in model.state_dict().items()}


def wait_for_row(evals, count, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evals.poll()
        if evals.path.exists() and len(read_rows(evals.path)) >= count:
            return read_rows(evals.path)
        time.sleep(0.1)
    raise AssertionError(f"no {count} evaluation rows within {timeout} s")


@pytest.mark.slow  # the evaluation process
def test_evaluations_come_due_at_the_interval_and_are_skipped_while_one_plays(tmp_path):
    cfg, evals = evaluations(tmp_path, "eval.interval_steps=1000", "total_steps=10000", "test.epsilon=0.25")
    snapshot = weights_of(cfg)
    taken = []

    def counted(step):  # the run's snapshot: the step it was taken at (here an update later) and the weights
        def take():
            taken.append(step)
            return step + 10, snapshot()

        return take

    try:
        evals.maybe_start(999, counted(999))
        assert not taken  # not due yet
        evals.maybe_start(1000, counted(1000))
        evals.maybe_start(2000, counted(2000))  # due, but the first still plays (its process is still starting)
        assert taken == [1000] and evals.next_step == 3000
        (row,) = wait_for_row(evals, 1)
        assert row["step"] == 1010 and row["episodes"] == 2 and row["final"] is False  # the snapshot's step
        assert row["seed"] == eval_seed(cfg.seed)
        assert row["greedy"] is True and row["epsilon"] == 0.25  # test mode's protocol, recorded
        evals.maybe_start(3500, counted(3500))  # due again: the next due step follows the step it came at
        assert evals.next_step == 4000
        rows = wait_for_row(evals, 2)
        assert [r["step"] for r in rows] == [1010, 3510]
        assert [r["step"] for r in evals.sinks[0].rows] == [1010, 3510]
        assert set(evals.sinks[0].rows[0]) >= {"step", "mean_return", "std_return", "episodes"}
    finally:
        evals.close()


def test_the_final_evaluation_is_written_once(tmp_path):
    cfg, evals = evaluations(tmp_path, "total_steps=5000")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        row = evals.final(5000, weights_of(cfg)())
        assert torch.get_num_threads() == 2, "played in the learner's process, which keeps its thread count"
    finally:
        torch.set_num_threads(threads)
    assert row["final"] is True and row["step"] == 5000 and row["epsilon"] == 0.0
    assert evals.final(5000, weights_of(cfg)()) is None  # a run resumed at its end: not again
    assert evals.scores() == [(5000, row["mean_return"], True)]


def test_no_final_evaluation_when_evaluation_is_off(tmp_path):
    cfg, evals = evaluations(tmp_path, "total_steps=5000", "eval.interval_steps=0")
    assert evals.final(5000, weights_of(cfg)()) is None and not evals.path.exists()


@pytest.mark.slow  # the evaluation process
def test_a_failing_evaluation_turns_evaluation_off_and_training_goes_on(tmp_path):
    cfg, evals = evaluations(tmp_path, "eval.interval_steps=100", "total_steps=10000")
    try:
        evals.maybe_start(100, lambda: (100, {"not": "the model's weights"}))
        deadline = time.monotonic() + 60
        while evals.next_step is not None and time.monotonic() < deadline:
            evals.poll()
            time.sleep(0.1)
        assert evals.next_step is None and evals._process is None
    finally:
        evals.close()


def test_evaluation_seeds_are_never_a_training_envs():
    for run_seed in (0, 1, 12345, 10**9):
        # every env of 10,000 actors of 256 envs each (restarts and reconnects count on)
        assert actor_seed(run_seed, 10_000, 256) < EVAL_SEED_BASE <= eval_seed(run_seed)
    assert eval_seed(1) != eval_seed(2)


def training_run_with(tmp_path, objective, scores, train_returns):
    """What final_return reads of a finished run."""
    rows = [dict(step=s, mean_return=r, final=f) for s, r, f in scores]
    evals = SimpleNamespace(scores=lambda: [(r["step"], r["mean_return"], r["final"]) for r in rows])
    return SimpleNamespace(
        cfg=SimpleNamespace(eval=SimpleNamespace(objective=objective)),
        evaluations=evals,
        stats=SimpleNamespace(recent_returns=RecentReturns(returns=train_returns)),
        csv_path=tmp_path / "logs.csv",
    )


def test_the_sweep_objective_is_the_final_or_best_evaluation(tmp_path):
    scores = [(100, 5.0, False), (200, 9.0, False), (300, 7.0, True)]
    assert final_return(training_run_with(tmp_path, "final", scores, [1.0, 3.0])) == 7.0
    assert final_return(training_run_with(tmp_path, "best", scores, [1.0, 3.0])) == 9.0
    assert final_return(training_run_with(tmp_path, "train", scores, [1.0, 3.0])) == 2.0
    assert final_return(training_run_with(tmp_path, "final", [], [1.0, 3.0])) == 2.0  # no evaluation: training's


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_evaluations_are_written_while_training_goes_on(tmp_path, backend):
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"backend={backend}", "total_steps=20000", "eval.interval_steps=4000", "eval.episodes=2"]
    run_cli(run_dir, *overrides, timeout=300)
    evals = read_rows(run_dir / "eval.csv")
    periodic = [row for row in evals if not row["final"]]
    assert len(periodic) >= 2, evals  # at least two of the four due came back while training went on
    steps = [row["step"] for row in periodic]
    assert steps == sorted(set(steps)) and steps[0] >= 4000 and steps[-1] < 20000
    trained = read_rows(run_dir)
    assert [row["step"] for row in evals if row["final"]] == [trained[-1]["step"]]  # at the run's last step
    assert any(row["step"] > periodic[0]["step"] for row in trained)


def write_scores(evals, *scores):
    for step, score in scores:
        evals._write(step, figures([score, score], [10, 10], 1.0), final=False)


def test_a_target_counts_as_met_once_the_next_evaluations_confirm_it():
    assert target_met([(1, 3.0), (2, 9.0), (3, 12.0)], 8, confirmations=0) == (2, 9.0)
    assert target_met([(1, 3.0), (2, 9.0), (3, 12.0)], 8, confirmations=1) == (3, 12.0)
    assert target_met([(1, 9.0), (2, 3.0), (3, 9.0), (4, 8.0)], 8, confirmations=1) == (4, 8.0)  # a miss restarts
    assert target_met([(1, 9.0), (2, 3.0), (3, 9.0)], 8, confirmations=1) is None
    assert target_met([], 8) is None


def test_a_target_met_before_the_checkpoint_is_read_back_on_resume(tmp_path):
    cfg, evals = evaluations(tmp_path, "eval.interval_steps=1000", "eval.stop_at_return=8", "eval.stop_confirmations=0")
    write_scores(evals, (1000, 3.0), (2000, 9.0), (3000, 12.0))
    assert evals.target_reached == (2000, 9.0)  # the first that met it
    assert Evaluations(cfg, tmp_path, [], resume_step=2500).target_reached == (2000, 9.0)
    before = Evaluations(cfg, tmp_path, [], resume_step=1500)  # the checkpoint predates it: not met
    assert before.target_reached is None
    _, without = evaluations(tmp_path, "eval.interval_steps=1000")  # no target: never met
    assert without.target_reached is None


def test_an_evaluation_that_meets_the_target_is_confirmed_by_the_next_at_once(tmp_path, caplog):
    cfg, evals = evaluations(tmp_path, "eval.interval_steps=1000", "eval.stop_at_return=8")  # one confirmation
    requested = []
    evals._start_process = lambda: setattr(evals, "_process", "started")
    evals._requests = SimpleNamespace(put=requested.append)
    evals._results = queue.Queue()  # results come here by _write, as poll() would write them
    evals.maybe_start(1000, lambda: (1000, "snapshot"))
    assert [step for step, _ in requested] == [1000]
    evals._in_flight = None
    write_scores(evals, (1000, 9.0))  # met, not yet confirmed: the next starts at once, not at 2000
    assert evals.target_reached is None
    evals._in_flight = 1000  # ...once the one playing has ended: meanwhile, no request and no "skipped"
    with caplog.at_level(logging.INFO, logger="torchbeast_hydra.evaluation.periodic"):
        evals.maybe_start(1050, lambda: (1050, "snapshot"))
    assert [step for step, _ in requested] == [1000] and "skipped" not in caplog.text
    evals._in_flight = None
    evals.maybe_start(1100, lambda: (1100, "snapshot"))
    assert [step for step, _ in requested] == [1000, 1100]
    evals._in_flight = None
    write_scores(evals, (1100, 3.0))  # fell short: back to the interval
    evals.maybe_start(1200, lambda: (1200, "snapshot"))
    assert len(requested) == 2 and evals.next_step == 2000
    write_scores(evals, (2000, 9.0), (2100, 8.5))
    assert evals.target_reached == (2100, 8.5)
    # A checkpoint between the two: the resumed run confirms at once, as the run would have.
    assert Evaluations(cfg, tmp_path, [], resume_step=2150).target_reached == (2100, 8.5)
    assert Evaluations(cfg, tmp_path, [], resume_step=2050)._confirming()


def test_a_resumed_run_drops_evaluations_past_its_checkpoint_at_once_and_counts_only_its_own(tmp_path):
    cfg, evals = evaluations(tmp_path, "eval.interval_steps=1000", "eval.stop_at_return=8", "eval.stop_confirmations=0")
    write_scores(evals, (1000, 3.0), (2000, 9.0))  # 2,000: played by an attempt that died before its checkpoint
    resumed = Evaluations(cfg, tmp_path, [], resume_step=1500)
    assert [row["step"] for row in read_rows(resumed.path)] == [1000]  # before any evaluation of its own
    assert resumed.target_reached is None
    # A mode=test row written into the run's eval.csv (no `final`) is not one of its evaluations.
    test_mode = CsvLog(resumed.path, resume_step=None, fields=["step", "mean_return"])
    test_mode.write(dict(step=1500, mean_return=9.0))
    test_mode.close()
    assert resumed.scores() == [(1000, 3.0, False)]
    assert Evaluations(cfg, tmp_path, [], resume_step=1500).target_reached is None


def test_a_target_without_evaluation_is_refused(tmp_path):
    result = run_cli(tmp_path / "run", *TINY, "eval.interval_steps=0", "eval.stop_at_return=100", check=False)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "eval.stop_at_return=100" in output and "eval.interval_steps" in output


@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_a_run_that_meets_its_target_is_complete_and_stays_so(tmp_path, backend):
    run_dir = tmp_path / "run"
    # Any CartPole episode returns at least 8: the first evaluation meets the target.
    overrides = [
        *TINY,
        f"backend={backend}",
        "total_steps=10000000",
        "eval.interval_steps=2000",
        "eval.stop_at_return=5",
    ]
    first = run_cli(run_dir, *overrides, timeout=300)
    output = first.stdout + first.stderr
    assert "met eval.stop_at_return" in output and "Finished:" in output
    trained = read_rows(run_dir)
    last_step = trained[-1]["step"]
    assert last_step < 1_000_000  # stopped far short of total_steps
    evals = read_rows(run_dir / "eval.csv")
    assert evals[0]["mean_return"] >= 5 and [row["step"] for row in evals if row["final"]] == [last_step]
    again = run_cli(run_dir, *overrides, timeout=300)  # a resume (a requeue, a sweep run again): nothing more
    assert "Finished:" in again.stdout + again.stderr
    assert read_rows(run_dir)[-1]["step"] == last_step and read_rows(run_dir / "eval.csv") == evals
