"""Sweeps, crashes, requeues and poly runs on a real SLURM cluster: the local one (`make slurm-start`).

The session fixture `slurm_cluster` (conftest.py) installs and starts it when needed. Every sweep
is bounded by a timeout: a launcher that waits forever fails the test instead of hanging CI.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_sweeps import JOB, check_job_dirs, job_dir_name

from torchbeast_hydra.run import checkpoint

from helpers import REPO, rows, run_sweep, start_cli, steps, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# One CPU per job so two run side by side on a 2-core node; no GPU here.
SLURM = [
    "hydra/launcher=slurm",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=30",
]


def finish(process, timeout):
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"the sweep did not finish in {timeout} s:\n{output}") from None
    return process.returncode, output


def job_ids(sweep_dir):
    """SLURM job ids of a sweep's jobs, from submitit's folders (.submitit/ARRAYID_TASK/, or JOBID/)."""
    names = sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir())
    return [name for name in names if "_" in name] or names  # an array's own folder holds its script


def job_pids(sweep_dir):
    """The sweep's submitit job processes (python -m submitit.core._submit FOLDER) on this node."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in args and any(str(sweep_dir).encode() in a for a in args):
            pids.append(int(cmdline.parent.name))
    return pids


def test_slurm_sweep(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    started = time.monotonic()
    result = run_sweep(
        sweep, *JOB, *SLURM, f"hydra.launcher.partition={slurm_cluster}", "total_steps=2048", "seed=1,2", timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    check_job_dirs(sweep, [job_dir_name(f"seed={s}") for s in (1, 2)])
    assert len(job_ids(sweep)) == 2  # one array job, two tasks
    print(f"SLURM sweep of 2 jobs: {time.monotonic() - started:.1f} s")


def test_unknown_partition_fails_before_anything_is_written(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(sweep, *JOB, *SLURM, "hydra.launcher.partition=nosuchpartition", "seed=1,2", timeout=120)
    assert result.returncode == 2
    assert (
        f"SLURM partition 'nosuchpartition' does not exist on this cluster (partitions: {slurm_cluster})"
        in result.stderr
    )
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
    assert not sweep.exists()


def test_a_job_that_crashes_hard_fails_the_sweep_clearly(slurm_cluster, tmp_path):
    # SIGKILL (as the OOM killer does): no result file, no Python cleanup. The launcher learns the
    # job's state from sacct (scripts/slurm/sacct on the local cluster) and reports the failure.
    sweep = tmp_path / "sweep"
    process = start_cli(sweep, *JOB, *SLURM, "total_steps=1000000", "seed=1", multirun=True)
    job_dir = sweep / job_dir_name(*JOB, "seed=1", "total_steps=1000000")  # one job: named by every override
    wait_for(lambda: (job_dir / "logs.csv").exists() and len(rows(job_dir)) >= 2, 120, "the job to train")
    for pid in job_pids(sweep):
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    code, output = finish(process, timeout=120)
    assert code != 0
    assert re.search(r"error: a sweep job failed .*\n.*\nhas not produced any output \(state: FAILED", output), output
    assert "site-packages/hydra" not in output, "no launcher traceback"
    print(f"hard crash reported {time.monotonic() - started:.1f} s after the kill")


# Each way of preemption is tested once against SLURM: a requeue (SIGTERM) here, USR2 on the
# two-rank preset below (outside SLURM, SIGTERM: tests/test_mono.py; SIGUSR2: tests/test_distributed.py).
@pytest.mark.parametrize("how", ["scontrol requeue"])
def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path, how):
    sweep = tmp_path / "sweep"
    total = 8192
    # Only the signal writes a checkpoint.
    process = start_cli(
        sweep, *JOB, *SLURM, f"total_steps={total}", "seed=1", "checkpoint_interval_s=3600", multirun=True
    )
    job_dir = sweep / job_dir_name(*JOB, "seed=1", f"total_steps={total}", "checkpoint_interval_s=3600")
    wait_for(lambda: (job_dir / "logs.csv").exists() and len(rows(job_dir)) >= 10, 120, "the job to train")
    (job_id,) = job_ids(sweep)
    if how == "USR2":  # what SLURM sends before the time limit and on preemption
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    else:  # SIGTERM to the job, which SLURM puts back in the queue
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    # SLURM holds a requeued job (BeginTime, about 2 min: until the old job's credential expires).
    # Once the old attempt is gone and a new second has begun (slurmd refuses a credential made in
    # the second it revoked the old one), let it start at once.
    wait_for(
        lambda: (
            "JobState=PENDING"
            in subprocess.run(["scontrol", "show", "job", job_id], text=True, capture_output=True).stdout
        ),
        60,
        "the requeue",
    )
    wait_for(lambda: not job_pids(sweep), 60, "the first attempt to exit")
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)
    code, output = finish(process, timeout=180)
    assert code == 0, output

    log = (job_dir / "torchbeast.log").read_text()
    assert f"Received {'SIGUSR2' if how == 'USR2' else 'SIGTERM'}" in log
    stopped = int(re.search(r"Saved checkpoint at step (\d+)", log.split("Received SIG")[1]).group(1))
    assert "died with exit code" not in log, "actors are not replaced while the run stops"
    assert f"at step {stopped}." in log.split("Resuming from")[1].splitlines()[0]
    assert 0 < stopped < total
    logged = steps(job_dir)
    assert logged == list(range(64, total + 1, 64)), "logs.csv continues: no duplicate or missing rows"
    state = checkpoint.load(checkpoint.path_in(job_dir))
    assert state["step"] == total
    assert state["learner"]["scheduler"]["last_epoch"] == total // 64, "LR schedule carried over"
    assert sorted(p.name for p in sweep.iterdir()) == sorted(
        [".submitit", ".sweep_overrides.yaml", "multirun.yaml", job_dir.name]
    ), "the requeued job kept its job dir"
    print(f"{how}: stopped at step {stopped}, resumed, finished at {total}")


def test_poly_learner_job_and_env_client_array_job(slurm_cluster, tmp_path):
    run_dir = tmp_path / "poly"
    overrides = [
        "experiment=cartpole",
        "total_steps=4096",
        "batch_size=4",
        "unroll_length=16",
        "backend.num_actors=1",
        "backend.envs_per_actor=2",
        "logger.log_interval_s=1",
    ]
    env = dict(
        os.environ,
        LEARNER_SBATCH="--cpus-per-task=1 --time=10",
        CLIENTS_SBATCH="--cpus-per-task=1 --time=10",
        PYTHON=os.sys.executable,
    )
    env.pop("TORCHBEAST_TOKEN", None)
    submitted = subprocess.run(
        [str(REPO / "scripts/slurm/poly.sh"), str(run_dir), "1", *overrides],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    learner, clients = re.search(r"learner job (\d+), env client array job (\d+)", submitted.stdout).groups()

    def states():
        out = subprocess.run(
            ["sacct", "-o", "JobID,State", "--parsable2", "-j", learner, "-j", clients],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return dict(line.split("|") for line in out.splitlines()[1:])

    try:
        finished = wait_for(
            lambda: (
                (s := states()) and all(v in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") for v in s.values()) and s
            ),
            120,
            "the poly jobs",
        )
    finally:
        subprocess.run(["scancel", learner, clients], timeout=30)  # no-op when they are done
    outputs = "\n".join(p.read_text() for p in sorted((run_dir / "slurm").iterdir()))
    assert finished == {learner: "COMPLETED", f"{clients}_0": "COMPLETED"}, outputs
    assert steps(run_dir)[-1] >= 4096
    assert int(rows(run_dir)[-1]["connected_clients"]) == 1
    assert (run_dir / "actorpool_address").read_text().strip().endswith(tuple("0123456789"))


def test_the_presets_defaults_that_no_node_has_stop_before_anything_is_written(slurm_cluster, tmp_path):
    # The preset asks for a GPU, 10 CPUs and 32 GB; the local node has 2 CPUs, ~21 GB and no GPU.
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep, *JOB, "hydra/launcher=slurm", f"hydra.launcher.partition={slurm_cluster}", "seed=1,2", timeout=120
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: each job asks for 10 CPUs") and f"partition '{slurm_cluster}'" in line
    assert "hydra.launcher.cpus_per_task=2" in line and "hydra.launcher.gpus_per_node=0" in line
    assert re.search(r"hydra\.launcher\.mem_gb=\d+", line) and "no GPUs" in line
    assert not sweep.exists()


def test_a_job_that_can_never_start_is_cancelled_and_reported(slurm_cluster, tmp_path):
    # A job that depends on a failed one pends with DependencyNeverSatisfied: forever, unless reported.
    failed = subprocess.run(
        ["sbatch", "--parsable", f"--partition={slurm_cluster}", "--output=/dev/null", "--wrap", "false"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    wait_for(
        lambda: (
            "JobState=FAILED"
            in subprocess.run(["scontrol", "show", "job", failed], text=True, capture_output=True).stdout
        ),
        60,
        "the job to fail",
    )
    sweep = tmp_path / "sweep"
    started = time.monotonic()
    result = run_sweep(
        sweep,
        *JOB,
        *SLURM,
        f"hydra.launcher.partition={slurm_cluster}",
        "seed=1",
        f"+hydra.launcher.additional_parameters.dependency=afterok:{failed}",
        timeout=180,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"error: SLURM job \d+(_0)? was pending for a reason that waiting does not clear: "
        r"DependencyNeverSatisfied",
        result.stderr,
    ), result.stderr
    assert "Traceback" not in result.stderr
    (job_id,) = job_ids(sweep)
    state = subprocess.run(["scontrol", "show", "job", job_id], text=True, capture_output=True).stdout
    assert "JobState=CANCELLED" in state, "the hopeless job was cancelled, not left in the queue"
    print(f"reported {time.monotonic() - started:.1f} s after the sweep started")


@pytest.mark.parametrize("how", ["USR2"])
def test_ranks_preset_trains_two_ranks_in_one_job_dir_and_resumes_after_a_requeue(slurm_cluster, tmp_path, how):
    # hydra/launcher=slurm_ranks with 2 tasks on the one node (gloo): one job dir, rank 0 writes it;
    # the preemption signal (or a requeue's SIGTERM, which reaches the actors too) stops both ranks
    # after the same update with one checkpoint; the requeued job resumes and the step count continues.
    sweep = tmp_path / "sweep"
    total = 20480
    ranks = [
        "hydra/launcher=slurm_ranks",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.gpus_per_task=0",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1",
        "hydra.launcher.timeout_min=30",
        f"hydra.launcher.partition={slurm_cluster}",
    ]
    overrides = [*JOB, "eval.interval_steps=0", "eval.final=false", "distributed.timeout_s=60"]
    overrides += [f"total_steps={total}", "checkpoint_interval_s=3600"]  # only the signal writes a checkpoint
    started = time.monotonic()
    process = start_cli(sweep, *overrides, *ranks, multirun=True)
    try:
        job_dir = wait_for(
            lambda: [d for d in sweep.glob("*") if d.is_dir() and (d / "logs.csv").exists() and len(rows(d)) >= 2],
            120,
            "the job to train",
        )[0]
        (job_id,) = job_ids(sweep)
        if how == "USR2":  # SLURM's preemption and time-limit signal: submitit checkpoints and requeues
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        else:  # SIGTERM to every process of the job, actors included, which SLURM puts back in the queue
            subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        wait_for(
            lambda: (
                "JobState=PENDING"
                in subprocess.run(["scontrol", "show", "job", job_id], text=True, capture_output=True).stdout
            ),
            60,
            "the requeue",
        )
        wait_for(lambda: not job_pids(sweep), 60, "the first attempt to exit")
        time.sleep(2)  # see test_requeued_job_resumes_from_its_checkpoint
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)
        code, output = finish(process, timeout=180)
    finally:
        process.kill()
        if (sweep / ".submitit").is_dir():  # a failed test leaves no job behind
            subprocess.run(["scancel", *job_ids(sweep)], timeout=30)
    assert code == 0, output

    log = (job_dir / "torchbeast.log").read_text()
    follower = (sweep / ".submitit" / job_id / f"{job_id}_1_log.out").read_text()
    assert log.count("ranks    2 (gloo)") == 2  # rank 0's summary, in each attempt
    assert log.count("Memory estimate") == 2, "rank 1 writes nothing to the run's log"
    signal_name = "SIGUSR2" if how == "USR2" else "SIGTERM"
    assert f"Received {signal_name}" in log and f"Received {signal_name}" in follower  # both ranks got it
    assert log.count("Saved checkpoint") == 2  # the signal's, and the end's
    stopped = int(re.search(r"Saved checkpoint at step (\d+)", log).group(1))
    assert 0 < stopped < total
    assert f"at step {stopped}." in log.split("Resuming from")[1].splitlines()[0]
    assert "died with exit code" not in log + follower, "actors are not replaced while the ranks stop"
    assert steps(job_dir) == list(range(128, total + 1, 128)), "two ranks' steps per row, continued"
    state = checkpoint.load(checkpoint.path_in(job_dir))
    assert (state["step"], state["ranks"]) == (total, 2)
    assert sorted(p.name for p in sweep.iterdir()) == sorted(
        [".submitit", ".sweep_overrides.yaml", "multirun.yaml", job_dir.name]
    ), "one job dir for both ranks and both attempts"
    took = time.monotonic() - started
    print(f"{how}: 2 ranks stopped at step {stopped}, resumed, finished at {total} in {took:.0f} s")


def test_a_population_runs_as_a_slurm_array_whose_members_meet_in_the_sweep_dir(slurm_cluster, tmp_path):
    # pbt=default on the SLURM launcher: the members are one array job's tasks, each in its own job
    # dir, all publishing to SWEEP_DIR/pbt. Starting at learning rates 0.01 and 1e-7, their scores part
    # (0.01 learns or collapses within a few thousand steps; 1e-7 stays at random play), so the worse
    # one copies the other at one of its publishes (which one is left to chance: either way is PBT).
    from torchbeast_hydra.pbt import population

    sweep = tmp_path / "sweep"
    started = time.monotonic()
    result = run_sweep(
        sweep,
        *JOB,
        *SLURM,
        f"hydra.launcher.partition={slurm_cluster}",
        "pbt=default",
        "pbt.population=2",
        "total_steps=8192",
        "pbt.interval_steps=2048",
        "pbt.start=config",
        "pbt.mutate.optim.learning_rate.low=1e-7",
        "pbt.mutate.optim.learning_rate.start=[0.01,1e-7]",
        "eval.interval_steps=0",
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    members = sorted(p.name for p in sweep.iterdir() if p.name.startswith("pbt.member="))
    assert members == ["pbt.member=0", "pbt.member=1"] and population.is_population(sweep / "pbt")

    # The members ran as SLURM jobs: the tasks of one array, each one member, both COMPLETED.
    tasks = job_ids(sweep)
    array = tasks[0].split("_")[0]
    assert tasks == [f"{array}_0", f"{array}_1"]
    for member, task in enumerate(tasks):
        output = (sweep / ".submitit" / task / f"{task}_0_log.out").read_text()
        assert f"JobEnvironment(job_id={task}," in output and f"Population member {member} of 2" in output

    def states():
        out = subprocess.run(
            ["sacct", "-o", "JobID,State", "--parsable2", "-j", array], capture_output=True, text=True, timeout=30
        ).stdout
        return dict(line.split("|") for line in out.splitlines()[1:])

    # A task's result file is written just before its process exits, so SLURM may still say RUNNING.
    wait_for(lambda: all(states().get(task) == "COMPLETED" for task in tasks), 60, "both array tasks COMPLETED (sacct)")

    # Both members' rows in the population's table: a start, then a publish in every interval (the
    # first beat past its end) to the last step.
    rows = population.read_table(sweep / "pbt")
    for member, name in enumerate(members):
        mine = [r for r in rows if r["member"] == member]
        assert mine[0]["event"] == "start" and mine[0]["run_dir"] == f"../{name}"
        published = [r["step"] for r in mine if r["event"] == "publish"]
        assert [step // 2048 for step in published] == [1, 2, 3, 4] and published[-1] == 8192  # once per interval
        assert checkpoint.load(checkpoint.path_in(sweep / name))["step"] == 8192
        assert checkpoint.load(population.published_path(sweep / "pbt", member))["step"] == 8192

    # At least one exploit: the worse member copied the other's published checkpoint, and its own
    # final checkpoint carries that lineage.
    exploits = [r for r in rows if r["event"] == "exploit"]
    assert exploits, "no member copied the other: " + str(rows)
    for row in exploits:
        assert row["exploited_from"] == 1 - row["member"] and 0 < row["from_step"] <= 8192
    first = exploits[0]
    lineage = checkpoint.load(checkpoint.path_in(sweep / members[first["member"]]))["extras"]["pbt"]["lineage"]
    assert lineage[0] == dict(step=first["step"], source=first["exploited_from"], source_step=first["from_step"])
    print(f"SLURM population of 2: {len(exploits)} exploit(s), {time.monotonic() - started:.1f} s")
