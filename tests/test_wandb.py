"""wandb: offline runs read back with wandb's own record schema; resume; failures; test mode.

No test touches the network: the CLI runs with no credentials and `logger.wandb.mode=offline`,
except the failure test, which points wandb at a closed port on this machine.
"""

import shutil
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import wandb

from torchbeast_hydra.config import validate
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.logs import wandb_log
from torchbeast_hydra.logs.wandb_log import WandbLog, numeric_fields, resolve_mode, run_id_for

from helpers import TINY, cli_env, compose_config, csv_dicts, run_cli, sweep_job_dir
from wandb_records import offline_runs

OFFLINE = [*TINY, "backend.num_actors=1", "logger.wandb.mode=offline"]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """A tiny training run logged to an offline wandb run; returns (run_dir, CLI output)."""
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    result = run_cli(run_dir, *OFFLINE, "seed=3")
    return run_dir, result.stdout + result.stderr


def first_run(run_dir):
    runs = offline_runs(run_dir)
    assert runs, "no offline wandb run"
    return runs[0]


# End to end, through the CLI.


@pytest.mark.slow
def test_offline_run_logs_every_csv_field_against_step_with_the_config(offline_run):
    run_dir, output = offline_run
    run = first_run(run_dir)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert run["run"].run_id == run_id and run["run"].project == "torchbeast_hydra"
    # Tags from the env/model/backend choices; group from the experiment; name from the overrides.
    assert list(run["run"].tags) == ["cartpole", "mlp", "mono"]
    assert run["run"].run_group == "cartpole"
    name = run["run"].display_name
    assert name.startswith("experiment=cartpole,total_steps=2560,") and len(name) <= 128
    # The resolved config.
    assert run["config"]["seed"] == 3 and run["config"]["env"]["id"] == "CartPole-v1"
    assert run["config"]["logger"]["wandb"]["mode"] == "offline"
    assert run["config"]["model"]["_target_"] == "torchbeast_hydra.agent.models.MLPBody"
    # `step` is the x-axis of everything.
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in run["metrics"])
    # One history row per logs.csv row, with every numeric field and the same values.
    rows = csv_dicts(run_dir / "logs.csv")
    history = run["history"]
    assert [h["step"] for h in history] == [int(r["step"]) for r in rows] == list(range(64, 2561, 64))
    for logged, row in zip(history, rows):
        for key, value in row.items():
            if key == "episode_returns":
                assert key not in logged
            elif value == "":
                assert key not in logged
            else:
                assert logged[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), key
    assert run["exit_code"] == 0, "the run was finished"
    assert f"wandb sync {run_dir / 'wandb'}/offline-run-" in output


@pytest.mark.slow
def test_resume_continues_the_same_wandb_run(offline_run, tmp_path):
    run_dir = shutil.copytree(offline_run[0], tmp_path / "run")  # the module's run stays as it finished
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    run_cli(run_dir, *OFFLINE, "seed=3", "total_steps=3840")
    runs = offline_runs(run_dir)
    resumed = [r for r in runs if r["history"] and r["history"][0]["step"] == 2624]
    assert len(resumed) == 1, "one more offline run, continuing after the checkpoint"
    assert resumed[0]["run"].run_id == run_id
    assert [h["step"] for h in resumed[0]["history"]] == list(range(2624, 3841, 64))
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id


@pytest.mark.slow
def test_test_mode_logs_its_evaluation_and_video_to_the_trained_run(offline_run, tmp_path):
    run_dir, _ = offline_run
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    run_cli(
        tmp_path / "eval",
        "experiment=cartpole",
        "mode=test",
        f"load_dir={run_dir}",
        "test.num_episodes=2",
        "test.record_video=true",
        "logger.wandb.mode=offline",
    )
    result = csv_dicts(tmp_path / "eval" / "eval.csv")[-1]
    # The trained run's wandb run goes on, its files in the test run's dir (the trained dir is only read).
    assert not [r for r in offline_runs(run_dir) if r["history"] and "eval/mean_return" in r["history"][0]]
    evals = [r for r in offline_runs(tmp_path / "eval") if r["history"] and "eval/mean_return" in r["history"][0]]
    assert len(evals) == 1
    (logged,) = evals[0]["history"]
    assert evals[0]["run"].run_id == run_id
    assert logged["step"] == int(result["step"])
    assert logged["eval/mean_return"] == pytest.approx(float(result["mean_return"]))
    assert logged["eval/episodes"] == 2
    assert logged["eval/video._type"] == "video-file"
    assert any(path.endswith(".mp4") for path in evals[0]["files"])
    # The evaluation does not rename or re-tag the training run.
    assert evals[0]["run"].display_name == "" and not evals[0]["config"].get("seed")


@pytest.mark.slow
def test_each_multirun_job_is_its_own_finished_run_grouped_by_the_sweep(tmp_path):
    sweep_dir = tmp_path / "lr_sweep"
    run_cli(sweep_dir, *OFFLINE, "seed=1,2", multirun=True, timeout=300)
    jobs = [sweep_job_dir(sweep_dir, f"seed={seed}") for seed in (1, 2)]
    runs = [first_run(job) for job in jobs]
    ids = [(job / "wandb_run_id").read_text().strip() for job in jobs]
    assert [r["run"].run_id for r in runs] == ids and ids[0] != ids[1]
    assert [r["run"].run_group for r in runs] == ["lr_sweep", "lr_sweep"]
    assert [r["run"].display_name for r in runs] == ["seed=1", "seed=2"]  # the swept overrides
    assert [r["config"]["seed"] for r in runs] == [1, 2]
    assert all(r["exit_code"] == 0 for r in runs), "each job finished its run"
    assert all(r["history"][-1]["step"] == 2560 for r in runs)


@pytest.mark.slow
def test_wandb_that_cannot_start_does_not_stop_training(tmp_path):
    with socket.socket() as s:  # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_cli(
        run_dir,
        *TINY,
        "backend.num_actors=1",
        "logger.wandb.mode=online",
        "logger.wandb.init_timeout_s=4",
        env=cli_env(WANDB_MODE=None, WANDB_API_KEY="x" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{port}"),
    )
    output = result.stdout + result.stderr
    assert output.count("Training goes on without wandb") == 1, output
    assert "wandb did not start" in output and f"127.0.0.1:{port}" in output, output
    assert [int(r["step"]) for r in csv_dicts(run_dir / "logs.csv")] == list(range(64, 2561, 64))
    assert time.monotonic() - started < 90


# In-process: the sink's contract, without the CLI.


def settings(**overrides):
    base = dict(mode="offline", project="p", entity=None, group=None, name=None, tags=[], init_timeout_s=5.0)
    return SimpleNamespace(**{**base, **overrides})


def test_numeric_fields_keep_every_number_and_skip_the_rest():
    row = dict(
        step=64,
        sps=10.5,
        mean_episode_return="",
        episode_returns="[1.0, 2.0]",
        learner_queue_size=3,
        connected_clients=2,
        flag=True,
        note="x",
    )
    assert numeric_fields(row) == dict(step=64, sps=10.5, learner_queue_size=3, connected_clients=2)


def test_auto_mode_is_online_only_with_credentials(tmp_path):
    no_netrc = dict(NETRC=str(tmp_path / "missing"))
    assert resolve_mode("auto", no_netrc) == "offline"
    assert resolve_mode("auto", dict(no_netrc, WANDB_API_KEY="k" * 40)) == "online"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert resolve_mode("auto", dict(NETRC=str(netrc))) == "online"
    assert resolve_mode("auto", dict(no_netrc, WANDB_MODE="disabled")) == "disabled"
    assert resolve_mode("offline", dict(WANDB_API_KEY="k" * 40)) == "offline"


def test_run_id_is_kept_in_the_run_dir(tmp_path):
    first = run_id_for(tmp_path)
    assert first == run_id_for(tmp_path) == (tmp_path / "wandb_run_id").read_text().strip()
    assert run_id_for(tmp_path / "other") != first


def test_config_validation():
    cfg = compose_config(["logger.wandb.mode=offline", "logger.wandb.tags=[a,b]"])
    validate(cfg)
    cfg.logger.wandb.project = "a/b"
    with pytest.raises(ConfigError, match="logger.wandb.project"):
        validate(cfg)
    with pytest.raises(Exception, match="mode"):
        compose_config(["logger.wandb.mode=sometimes"])


def test_disabled_sink_does_nothing(tmp_path):
    sink = WandbLog(settings(mode="disabled"), tmp_path)
    assert not sink.active
    sink.write(dict(step=1))
    sink.close()
    assert not (tmp_path / "wandb_run_id").exists()


def test_init_error_warns_once_and_disables(tmp_path, monkeypatch, caplog):
    def broken_init(**kwargs):
        raise wandb.errors.CommError("bad API key")

    monkeypatch.setattr(wandb, "init", broken_init)
    sink = WandbLog(settings(), tmp_path)
    assert not sink.active
    sink.write(dict(step=1))
    sink.close()
    warnings = [r for r in caplog.records if "Training goes on without wandb" in r.getMessage()]
    assert len(warnings) == 1 and "bad API key" in warnings[0].getMessage()


def test_init_that_hangs_is_abandoned_after_the_timeout(tmp_path, monkeypatch, caplog):
    release = threading.Event()

    def hanging_init(**kwargs):
        release.wait(30)
        raise RuntimeError("gave up")

    monkeypatch.setattr(wandb, "init", hanging_init)
    started = time.monotonic()
    sink = WandbLog(settings(init_timeout_s=0.5), tmp_path)
    assert time.monotonic() - started < 5 and not sink.active
    sink.write(dict(step=1))
    sink.close()
    release.set()
    assert "did not start within 0.5 s" in caplog.text


class FlakyRun:
    """A wandb run whose log fails on the second call."""

    def __init__(self):
        self.logged, self.finished = [], False
        self.settings = SimpleNamespace(sync_dir="/nowhere")
        self.summary = {}

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, metrics, step=None):
        if self.logged:
            raise BrokenPipeError("wandb service went away")
        self.logged.append(metrics)

    def finish(self):
        self.finished = True


def test_logging_error_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    run = FlakyRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    sink = WandbLog(settings(), tmp_path)
    for step in range(1, 5):
        sink.write(dict(step=step, sps=1.0, episode_returns="[]"))
    sink.close(timeout_s=5)
    assert run.logged == [dict(step=1, sps=1.0)] and run.finished
    assert caplog.text.count("Training goes on without wandb") == 1
    assert "wandb service went away" in caplog.text


class RecordingRun(FlakyRun):
    """A wandb run that keeps what is logged, at which wandb step; `resumed` at `step` as told."""

    def __init__(self, resumed=False, step=0):
        super().__init__()
        self.resumed, self.step = resumed, step
        self.id, self.url = "abc123", "https://wandb.example/abc123"

    def log(self, metrics, step=None):
        self.logged.append((step, metrics.get("step")))


def resumed_sink(tmp_path, monkeypatch, mode, runs, resume_step=2560):
    """A sink for a run resumed from a checkpoint at resume_step; wandb.init answers from `runs`
    (a run, or an exception to raise) in turn. Returns (sink, the init calls' arguments)."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        answer = runs.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(wandb, "init", init)
    (tmp_path / "wandb_run_id").write_text("abc123\n")
    return WandbLog(settings(mode=mode), tmp_path, resume_step=resume_step), calls


def test_an_online_run_resumed_from_a_checkpoint_rewinds_wandb_to_it(tmp_path, monkeypatch):
    run = RecordingRun()
    sink, calls = resumed_sink(tmp_path, monkeypatch, "online", [run])
    (call,) = calls
    assert call["resume_from"] == "abc123?_step=2561"  # rows past the checkpoint's step are dropped
    assert "id" not in call and "resume" not in call  # wandb refuses resume_from beside them
    for step in (2624, 2688):
        sink.write(dict(step=step, sps=1.0))
    sink.close(timeout_s=5)
    assert run.logged == [(2624, 2624), (2688, 2688)], "wandb's own step is the training step"


def test_where_wandb_cannot_rewind_the_run_continues_without_repeating_steps(tmp_path, monkeypatch, caplog):
    # The crashed attempt logged up to step 3200; wandb continues the run at its next step, 3201.
    run = RecordingRun(resumed=True, step=3201)
    sink, calls = resumed_sink(tmp_path, monkeypatch, "online", [wandb.errors.CommError("rewind is not enabled"), run])
    assert [c.get("resume_from") for c in calls] == ["abc123?_step=2561", None]
    assert calls[1]["id"] == "abc123" and calls[1]["resume"] == "allow"
    for step in range(2624, 3400, 64):
        sink.write(dict(step=step, sps=1.0))
    sink.close(timeout_s=5)
    assert [step for step, _ in run.logged] == list(range(3264, 3400, 64)), "no step is sent twice"
    assert "could not rewind run abc123" in caplog.text and "Training goes on without wandb" not in caplog.text


@pytest.mark.parametrize("mode, resume_step", [("offline", 2560), ("online", 0)])
def test_offline_and_new_runs_continue_or_start_the_run(tmp_path, monkeypatch, mode, resume_step):
    sink, calls = resumed_sink(tmp_path, monkeypatch, mode, [RecordingRun()], resume_step=resume_step)
    sink.close(timeout_s=5)
    (call,) = calls
    assert call["id"] == "abc123" and call["resume"] == "allow" and "resume_from" not in call


def test_hydra_labels_outside_hydra_are_empty():
    assert wandb_log.hydra_labels() == (None, None, [])
    assert wandb_log.sweep_name(wandb_log.Path("outputs/multirun/2024-05-01/12-00-00")) == "2024-05-01/12-00-00"
