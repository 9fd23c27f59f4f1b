import csv

import pytest

from torchbeast_hydra.logs.metrics import CsvLog, Stats, read_rows

from helpers import csv_dicts


def read_steps(path):
    return [int(row["step"]) for row in csv_dicts(path)]


def test_resume_drops_rows_past_the_checkpoint(tmp_path):
    path = tmp_path / "logs.csv"
    log = CsvLog(path, resume_step=None)
    for step in (10, 20, 30, 40):
        log.write(dict(step=step, sps=1.0))
    log.close()
    with open(path, "a") as f:
        f.write("50,1.0,")  # a torn last line from a killed process
    log = CsvLog(path, resume_step=20)
    log.write(dict(step=30, sps=2.0))
    log.close()
    assert read_steps(path) == [10, 20, 30]


@pytest.mark.parametrize("torn", ["200,2.5", "200,2.5,1"])  # too few cells; all of them, the last cut short
def test_a_torn_last_line_is_dropped_before_the_next_row_is_appended(tmp_path, torn):
    path, fields = tmp_path / "eval.csv", ["step", "mean_return", "episodes"]
    log = CsvLog(path, resume_step=None, fields=fields)
    log.write(dict(step=100, mean_return=1.0, episodes=10))
    log.close()
    with open(path, "a") as f:
        f.write(torn)  # a process killed mid-row: no line end
    log = CsvLog(path, resume_step=None, fields=fields)  # as mode=test appends a row
    log.write(dict(step=300, mean_return=3.0, episodes=10))
    log.close()
    assert [(r["step"], r["mean_return"], r["episodes"]) for r in read_rows(path)] == [(100, 1.0, 10), (300, 3.0, 10)]


def test_stats_rows_and_progress_line(tmp_path):
    log = CsvLog(tmp_path / "logs.csv", resume_step=None)
    stats = Stats(start_step=100, total_steps=1000, sinks=[log])
    row = stats.record(50, [1.0, 3.0], dict(total_loss=0.5), dict(free_queue_size=2, full_queue_size=0))
    assert row["step"] == 150 and row["mean_episode_return"] == 2.0 and row["episodes"] == 2
    row = stats.record(50, [], dict(total_loss=0.25), {})
    assert row["mean_episode_return"] == "" and stats.mean_recent_return == 2.0
    line = stats.progress_line()
    assert "step 200/1,000" in line and "2.00 over last 2 episodes" in line
    stats.close()
    assert read_steps(tmp_path / "logs.csv") == [150, 200]


def test_a_new_statistic_gets_its_own_column_and_survives_a_resume(tmp_path):
    path = tmp_path / "logs.csv"
    log = CsvLog(path, resume_step=None)
    log.write(dict(step=10, total_loss=1.0))
    log.write(dict(step=20, total_loss=0.5, kl_loss=0.25))  # a loss term added by the user
    log.close()
    rows = csv_dicts(path)
    assert [row["kl_loss"] for row in rows] == ["", "0.25"]
    assert rows[0]["total_loss"] == "1.0"
    # Resuming keeps the widened header; a further new key (and one the code has since dropped) too.
    log = CsvLog(path, resume_step=20)
    log.write(dict(step=30, kl_loss=0.125, aux_loss=2.0))
    log.close()
    rows = csv_dicts(path)
    assert [row["step"] for row in rows] == ["10", "20", "30"]
    assert [row["kl_loss"] for row in rows] == ["", "0.25", "0.125"]
    assert [row["aux_loss"] for row in rows] == ["", "", "2.0"]
    with open(path, newline="") as f:
        lengths = {len(line) for line in csv.reader(f)}
    assert len(lengths) == 1, "one rectangular table"


def test_stats_rows_keep_every_numeric_statistic_of_any_backend(tmp_path):
    log = CsvLog(tmp_path / "logs.csv", resume_step=None)
    stats = Stats(start_step=0, total_steps=100, sinks=[log])
    stats.record(10, [], dict(total_loss=0.5, my_statistic=7.0), dict(connected_clients=3))
    stats.close()
    (row,) = csv_dicts(tmp_path / "logs.csv")
    assert row["my_statistic"] == "7.0" and row["connected_clients"] == "3"


class Clock:
    """A stand-in for time.monotonic that tests move by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_steps_per_second_start_at_the_first_update_and_follow_a_recent_window(monkeypatch):
    from torchbeast_hydra.logs import metrics

    clock = Clock()
    monkeypatch.setattr(metrics.time, "monotonic", clock)
    stats = Stats(start_step=0, total_steps=10**6)
    assert "waiting for the first rollouts" in stats.progress_line()
    clock.now += 60.0  # start-up: actors spawning, first rollouts; none of it is throughput
    row = stats.record(100, [], {}, {})
    assert row["sps"] == "" and stats.sps is None and "measuring" in stats.progress_line()
    for _ in range(10):  # 100 steps a second from then on
        clock.now += 1.0
        row = stats.record(100, [], {}, {})
    assert row["sps"] == 100.0, "no ramp from the start-up minute"
    for _ in range(60):  # then twice as fast: the figure follows within the window
        clock.now += 1.0
        row = stats.record(200, [], {}, {})
    assert row["sps"] == 200.0
    assert "@ 200 SPS" in stats.progress_line()
    assert row["time_s"] == 130.0, "time_s stays the wall-clock time since the start"


def test_progress_never_passes_100_percent():
    stats = Stats(start_step=0, total_steps=1000)
    stats.record(1010, [], {}, {})  # the last batch ends past total_steps
    assert "step 1,010/1,000 (100.0%)" in stats.progress_line()


def test_the_progress_line_names_the_loss_terms_it_sums():
    stats = Stats(start_step=0, total_steps=1000)
    stats.record(50, [1.0], dict(total_loss=1.25, pg_loss=0.5, baseline_loss=0.8, entropy_loss=-0.05, kl_loss=0.0), {})
    assert "Loss 1.250 (pg 0.5, baseline 0.8, entropy -0.05, kl 0)." in stats.progress_line()
