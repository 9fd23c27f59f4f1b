import csv

from torchbeast_hydra.metrics import CsvLog, Stats


def read_steps(path):
    with open(path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


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
