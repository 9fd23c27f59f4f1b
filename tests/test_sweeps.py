"""-m sweeps through the basic launcher and submitit_local; launch errors before anything is written."""

import os
import sys

import pytest

from torchbeast_hydra import checkpoint
from torchbeast_hydra.launch import job_subdir

from conftest import REPO, rows, run_sweep, steps

# A sweep job: tiny CartPole (plus total_steps, a few thousand).
JOB = [
    "experiment=cartpole",
    "batch_size=4",
    "unroll_length=16",
    "backend.num_actors=1",
    "backend.envs_per_actor=2",
    "logger.log_interval_s=1",
]


def job_dir_name(*overrides):
    """What Hydra names a sweep job's dir: its overrides, sorted, joined by ','."""
    return ",".join(sorted(JOB + list(overrides)))


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
        assert float(last["sps"]) > 0 and int(last["episodes"]) > 0 and last["total_loss"] != ""
        assert checkpoint.load(checkpoint.path_in(job_dir))["step"] == total_steps
        assert (job_dir / ".hydra" / "overrides.yaml").exists() and (job_dir / "torchbeast.log").exists()


def test_job_subdir_names():
    assert job_subdir("env=pong,seed=1", 3) == "env=pong,seed=1"
    assert job_subdir("env.id=ALE/Pong-v5", 0) == "env.id=ALE_Pong-v5"
    assert job_subdir("", 7) == "job7"
    long = job_subdir("x=" + "a" * 300, 0)
    assert len(long) == 200 and long != job_subdir("x=" + "a" * 299 + "b", 0)


@pytest.mark.slow
def test_basic_launcher_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(sweep, *JOB, "total_steps=2048", "seed=1,2", "vtrace.entropy_cost=0.01,0.0006", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    check_job_dirs(
        sweep,
        [
            job_dir_name("total_steps=2048", f"seed={s}", f"vtrace.entropy_cost={e}")
            for s in (1, 2)
            for e in (0.01, 0.0006)
        ],
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
    check_job_dirs(sweep, [job_dir_name("total_steps=2048", f"seed={s}") for s in (1, 2)])
    starts = [
        (sweep / job_dir_name("total_steps=2048", f"seed={s}") / ".hydra" / "config.yaml").stat().st_mtime
        for s in (1, 2)
    ]
    ends = [(sweep / job_dir_name("total_steps=2048", f"seed={s}") / "logs.csv").stat().st_mtime for s in (1, 2)]
    assert max(starts) < min(ends), "the two jobs overlapped in time"


def test_launcher_preset_without_the_plugin_says_so(tmp_path):
    # The plugin is a dependency, so hide it: find_spec answers as if it were not installed.
    sweep = tmp_path / "sweep"
    code = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name.startswith('hydra_plugins.hydra_submitit') "
        "else real(name, *a)\n"
        "from torchbeast_hydra.__main__ import cli\n"
        "cli()\n"
    )
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", code, "-m", f"hydra.sweep.dir={sweep}", *JOB, "seed=1,2", "hydra/launcher=slurm"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "hydra/launcher=slurm needs the hydra-submitit-launcher plugin" in result.stderr
    assert "Traceback" not in result.stderr
    assert not sweep.exists()


def test_slurm_launch_without_sbatch_fails_clearly(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep, *JOB, "seed=1,2", "hydra/launcher=slurm", timeout=120, env=dict(os.environ, PATH=str(tmp_path / "empty"))
    )
    assert result.returncode == 2
    assert "submits jobs with sbatch, which is not on PATH" in result.stderr
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
    assert not sweep.exists()
