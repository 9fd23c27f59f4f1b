"""-m sweeps through the basic launcher and submitit_local; launch errors before anything is written."""

import signal

import pytest
from omegaconf import OmegaConf

from torchbeast_hydra.launch.jobs import RecordSweepOverrides, job_subdir
from torchbeast_hydra.run import checkpoint

from helpers import cli_env, rows, run_sweep, start_cli, steps, wait_for

# A sweep job: tiny CartPole (plus total_steps, a few thousand).
JOB = [
    "experiment=cartpole",
    "batch_size=4",
    "unroll_length=16",
    "backend.num_actors=1",
    "backend.envs_per_actor=2",
    "logger.log_interval_s=1",
]


def job_dir_name(*swept):
    """What a sweep job's dir is named: its swept overrides (a one-job sweep: all), sorted, joined by ','."""
    return ",".join(sorted(swept))


def check_job_dirs(sweep_dir, names, total_steps=2048):
    """Every job ran to total_steps in its own dir, named by its overrides, with sane figures."""
    assert sorted(
        p.name for p in sweep_dir.iterdir() if not p.name.startswith(".") and p.name != "multirun.yaml"
    ) == sorted(names)
    for name in names:
        job_dir = sweep_dir / name
        logged = steps(job_dir)
        assert logged == list(range(64, total_steps + 1, 64)), name
        last = rows(job_dir)[-1]
        assert float(last["sps"]) > 0 and int(last["episodes"]) > 0 and last["total_loss"] is not None
        assert checkpoint.load(checkpoint.path_in(job_dir))["step"] == total_steps
        assert (job_dir / ".hydra" / "overrides.yaml").exists() and (job_dir / "torchbeast.log").exists()


def start_sweep(sweep_dir, *command_line):
    """What Hydra hands the callbacks at a sweep's start: the sweep's command line and dir."""
    config = OmegaConf.create(dict(hydra=dict(overrides=dict(task=list(command_line)), sweep=dict(dir=str(sweep_dir)))))
    RecordSweepOverrides().on_multirun_start(config)


def test_job_dirs_are_named_by_the_swept_overrides(tmp_path):
    start_sweep(tmp_path, "experiment=cartpole", "seed=1,2", "total_steps=2048", "optim.learning_rate=range(1,3)")
    fixed = ["experiment=cartpole", "total_steps=2048"]
    names = {
        job_subdir([*fixed, f"seed={seed}", f"optim.learning_rate={lr}"], tmp_path, num)
        for num, (seed, lr) in enumerate((s, lr) for s in (1, 2) for lr in (1, 2))
    }
    assert names == {f"optim.learning_rate={lr},seed={s}" for s in (1, 2) for lr in (1, 2)}
    # Only the overrides decide it: a requeued job (another number, another process) finds its dir.
    again = job_subdir(OmegaConf.create([*fixed, "seed=2", "optim.learning_rate=1"]), str(tmp_path), 9)
    assert again == "optim.learning_rate=1,seed=2"
    # A value a sweeper set other than the command line's stays in the name: no two jobs share a dir.
    assert job_subdir(["experiment=cartpole", "total_steps=4096", "seed=1"], tmp_path, 0) == "seed=1,total_steps=4096"


def test_a_later_command_on_a_sweep_dir_keeps_its_job_dirs_and_never_resumes_another_config(tmp_path):
    start_sweep(tmp_path, "experiment=cartpole", "seed=1,2,3", "optim.learning_rate=0.001")
    fixed = ["experiment=cartpole", "optim.learning_rate=0.001"]
    assert job_subdir([*fixed, "seed=3"], tmp_path, 2) == "seed=3"
    # Seed 3 alone again (its one value now fixed on the command line): the same dir, to resume.
    start_sweep(tmp_path, "experiment=cartpole", "seed=3", "optim.learning_rate=0.001")
    assert job_subdir([*fixed, "seed=3"], tmp_path, 0) == "seed=3"
    # Another learning rate on the same dir: dirs of its own, not the other runs' checkpoints.
    start_sweep(tmp_path, "experiment=cartpole", "seed=1,2", "optim.learning_rate=0.01")
    assert job_subdir(["experiment=cartpole", "optim.learning_rate=0.01", "seed=1"], tmp_path, 0) == (
        "optim.learning_rate=0.01,seed=1"
    )


def test_a_later_command_adding_a_key_that_changes_nothing_learned_resumes_the_same_jobs(tmp_path):
    start_sweep(tmp_path, "env=pong", "seed=1,2,3", "total_steps=5000000")
    assert job_subdir(["env=pong", "total_steps=5000000", "seed=3"], tmp_path, 2) == "seed=3"
    # The same sweep again, now stopping at a target and logging offline: the same runs go on.
    later = ["env=pong", "total_steps=5000000", "eval.stop_at_return=18", "logger.wandb.mode=offline"]
    start_sweep(tmp_path, "seed=1,2,3", *later)
    assert job_subdir([*later, "seed=3"], tmp_path, 2) == "seed=3"
    assert job_subdir(["env=pong", "total_steps=5000000", "seed=3"], tmp_path, 2) == "seed=3"  # and without
    # Another target again: recorded beside the first, so a job of either command keeps its dir.
    start_sweep(tmp_path, "env=pong", "seed=3", "total_steps=5000000", "eval.stop_at_return=15")
    assert job_subdir(["env=pong", "total_steps=5000000", "eval.stop_at_return=15", "seed=3"], tmp_path, 0) == "seed=3"
    assert job_subdir([*later, "seed=3"], tmp_path, 0) == "seed=3"
    # A key that changes what is learned still gets dirs of its own.
    start_sweep(tmp_path, "env=pong", "seed=3", "total_steps=5000000", "vtrace.entropy_cost=0.02")
    assert job_subdir(["env=pong", "total_steps=5000000", "vtrace.entropy_cost=0.02", "seed=3"], tmp_path, 0) == (
        "seed=3,vtrace.entropy_cost=0.02"
    )


def test_job_dir_names_are_filesystem_safe(tmp_path):
    # No record of the sweep's command line: every override names the dir.
    assert job_subdir(["seed=1", "env=pong"], tmp_path, 3) == "env=pong,seed=1"
    assert job_subdir(["env.id=ALE/Pong-v5"], tmp_path, 0) == "env.id=ALE_Pong-v5"
    assert job_subdir([], tmp_path, 7) == "job7"
    long = job_subdir(["x=" + "a" * 300], tmp_path, 0)
    assert len(long) == 200 and long != job_subdir(["x=" + "a" * 299 + "b"], tmp_path, 0)
    start_sweep(tmp_path, "env.id=ALE/Pong-v5,ALE/Breakout-v5", "seed=1")
    assert job_subdir(["env.id=ALE/Pong-v5", "seed=1"], tmp_path, 0) == "env.id=ALE_Pong-v5"
    start_sweep(tmp_path, "seed=1")  # a one-job "sweep": nothing swept, named by its overrides
    assert job_subdir(["seed=1"], tmp_path, 0) == "seed=1"


@pytest.mark.slow
def test_basic_launcher_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(sweep, *JOB, "total_steps=640", "seed=1,2", "vtrace.entropy_cost=0.01,0.0006", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    check_job_dirs(
        sweep,
        [job_dir_name(f"seed={s}", f"vtrace.entropy_cost={e}") for s in (1, 2) for e in (0.01, 0.0006)],
        total_steps=640,
    )


@pytest.mark.slow
def test_submitit_local_sweep_runs_jobs_in_parallel(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep,
        *JOB,
        "total_steps=2048",
        "seed=1,2",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    check_job_dirs(sweep, [job_dir_name(f"seed={s}") for s in (1, 2)])
    starts = [(sweep / job_dir_name(f"seed={s}") / ".hydra" / "config.yaml").stat().st_mtime for s in (1, 2)]
    ends = [(sweep / job_dir_name(f"seed={s}") / "logs.csv").stat().st_mtime for s in (1, 2)]
    assert max(starts) < min(ends), "the two jobs overlapped in time"


def test_launcher_preset_without_the_plugin_says_so(tmp_path):
    # The plugin is a dependency, so hide it: find_spec answers as if it were not installed.
    sweep = tmp_path / "sweep"
    hidden = (
        "import importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name.startswith('hydra_plugins.hydra_submitit') "
        "else real(name, *a)"
    )
    result = run_sweep(sweep, *JOB, "seed=1,2", "hydra/launcher=slurm", timeout=120, prelude=hidden)
    assert result.returncode == 2
    assert "hydra/launcher=slurm needs the hydra-submitit-launcher plugin" in result.stderr
    assert "Traceback" not in result.stderr
    assert not sweep.exists()


def test_slurm_launch_without_sbatch_fails_clearly(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep, *JOB, "seed=1,2", "hydra/launcher=slurm", timeout=120, env=cli_env(PATH=str(tmp_path / "empty"))
    )
    assert result.returncode == 2
    assert "submits jobs with sbatch, which is not on PATH" in result.stderr
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
    assert not sweep.exists()


def test_a_fixed_override_names_no_dir_however_the_launcher_spells_it(tmp_path):
    start_sweep(tmp_path, "experiment=cartpole", "seed=1,2", "eval.final=false", "vtrace.discounting=0.990")
    # The basic launcher writes the job's overrides from the values it read: False, 0.99.
    assert job_subdir(
        ["experiment=cartpole", "eval.final=False", "vtrace.discounting=0.99", "seed=2"], tmp_path, 1
    ) == ("seed=2")


def test_ctrl_c_stops_the_whole_sweep_with_the_job_checkpointed(tmp_path):
    """SIGINT to a basic-launcher sweep stops the job it reached (checkpoint written) and the sweep:
    the next job does not start; the sweep's command again would resume it."""
    sweep = tmp_path / "sweep"
    process = start_cli(sweep, *JOB, "total_steps=10000000", "seed=1,2", multirun=True)
    first = sweep / "seed=1"
    try:
        wait_for(lambda: (first / "logs.csv").exists() and rows(first), 120, "the first job to train")
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGINT, output
    assert "The sweep stops here: SIGINT stopped its job." in output
    assert 0 < checkpoint.load(checkpoint.path_in(first))["step"] < 10000000
    assert not (sweep / "seed=2").exists()
