"""logger.tensorboard=true: logs.csv's numeric stats as TensorBoard scalars in RUN_DIR/tensorboard/."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchbeast_hydra.logs.tensorboard_log import TensorboardLog

from helpers import TINY, rows, run_cli


def scalars(log_dir):
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_a_tiny_run_writes_the_csv_stats_as_scalars(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(run_dir, *TINY, "backend.num_actors=1", "logger.tensorboard=true")
    logged = scalars(run_dir / "tensorboard")
    csv_rows = rows(run_dir)
    for stat in ("total_loss", "sps", "learning_rate", "episodes"):
        expected = {int(r["step"]): float(r[stat]) for r in csv_rows if r[stat] is not None}  # sps: none at first
        assert expected and logged[stat] == pytest.approx(expected, rel=1e-6), stat
    returns = {r["step"]: r["mean_episode_return"] for r in csv_rows if r["mean_episode_return"] is not None}
    assert returns and logged["mean_episode_return"] == pytest.approx(returns, rel=1e-6)
    assert "episode_returns" not in logged and "step" not in logged


def test_a_resumed_run_purges_what_came_after_its_checkpoint(tmp_path):
    sink = TensorboardLog(tmp_path)
    for step in (1, 2, 3):
        sink.write(dict(step=step, total_loss=float(step), episode_returns="[]", mean_episode_return=""))
    sink.close()
    sink = TensorboardLog(tmp_path, resume_step=1)  # the checkpoint was at step 1
    for step in (2, 3):
        sink.write(dict(step=step, total_loss=10.0 * step))
    sink.close()
    assert scalars(tmp_path / "tensorboard") == {"total_loss": {1: 1.0, 2: 20.0, 3: 30.0}}


def test_without_the_package_one_line_names_the_pip_command(tmp_path):
    hidden = "import sys\nsys.modules['torch.utils.tensorboard'] = None  # as if tensorboard were not installed"
    result = run_cli(tmp_path / "run", *TINY, "logger.tensorboard=true", check=False, prelude=hidden)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "pip install tensorboard" in output and "Traceback" not in output
