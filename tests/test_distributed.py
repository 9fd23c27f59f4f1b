"""Data-parallel ranks on torch.distributed (launch/distributed.py), with gloo on this CPU box.

The unit tests start two ranks once with torch.multiprocessing; the end-to-end ones start the command
with distributed.nproc=2 (the spawn-itself switch) or through torchrun, and kill, stop or signal
rank 1 (the child that the spawning rank 0 started)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_learner import learner_batch, learner_cfg, make_learner

from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.launch import distributed
from torchbeast_hydra.run.seeding import actor_seed, rank_seed

from helpers import SMALL, actor_pids, cli_env, rows, run_cli, wait_for

UPDATES = 5


def _start_rank(rank: int, port: int) -> distributed.Ranks:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    return distributed.Ranks(distributed.RankEnv(rank, 2, rank, 2), "gloo", timeout_s=30)


def _check_config(ranks, seed: int) -> str | None:
    """This rank's refusal (or None) of a config whose seed is `seed`, the rest the same on each rank."""
    cfg = learner_cfg()
    cfg.seed = seed
    try:
        ranks.check_same_config(cfg)
    except ConfigError as error:
        return str(error)
    return None


def _each_rank(rank: int, port: int, results) -> None:
    """One of two ranks, in one process group: checks configs that differ and configs that agree,
    then trains on its own batches, averaging gradients."""
    ranks = _start_rank(rank, port)
    different = _check_config(ranks, (1, 2)[rank])
    same = _check_config(ranks, 3)
    cfg = learner_cfg(total_steps=10_000)
    # The running statistics too must agree: PopArt's rescale the value head, the observations' its inputs.
    cfg.model.normalize_values = cfg.model.normalize_obs = True
    shared = make_learner(cfg, average_gradients=ranks.average_gradients, sum_over_ranks=ranks.sum_over_ranks)
    alone = make_learner(cfg)  # the same start, without averaging: the control
    losses = []
    for update in range(UPDATES):
        batch = learner_batch(cfg, seed=100 * rank + update)  # each rank its own batches
        losses.append(shared.update(batch, shared.model.initial_state(cfg.batch_size))["total_loss"])
        alone.update(batch, alone.model.initial_state(cfg.batch_size))
    # As numpy arrays: a tensor put on a queue travels as a shared-memory handle, gone with this process.
    weights = [p.detach().numpy().copy() for p in [*shared.model.parameters(), *shared.model.buffers()]]
    alone_weights = [p.detach().numpy().copy() for p in alone.model.parameters()]
    results.put((rank, dict(different=different, same=same, weights=weights, alone=alone_weights, losses=losses)))
    ranks.close()


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """What each of two rank processes (started once, with torch.multiprocessing) found, rank 0 first."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = distributed.free_port()
    processes = [context.Process(target=_each_rank, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    got = sorted([results.get(timeout=120) for _ in processes], key=lambda r: r[0])
    for process in processes:
        process.join(30)
    return [found for _, found in got]


@pytest.mark.slow  # two rank processes
def test_ranks_hold_identical_weights_after_updates_on_their_own_batches(two_ranks):
    first, second = two_ranks
    assert all(np.array_equal(a, b) for a, b in zip(first["weights"], second["weights"])), "the ranks' weights differ"
    assert first["losses"] == second["losses"]  # the logged figures are the ranks' mean, the same on every rank
    # Without averaging, the same start on these batches ends elsewhere: the averaging did the work.
    assert not all(np.array_equal(a, b) for a, b in zip(first["alone"], second["alone"]))
    assert not all(np.array_equal(a, b) for a, b in zip(first["weights"], first["alone"]))


@pytest.mark.slow  # two rank processes
def test_ranks_with_different_configs_are_refused(two_ranks):
    error0, error1 = (found["different"] for found in two_ranks)
    assert error0 and error1
    assert "seed: 2 on rank 1, 1 here" in error0 and "start every rank with the same overrides" in error0


@pytest.mark.slow  # two rank processes
def test_ranks_with_the_same_config_start(two_ranks):
    assert [found["same"] for found in two_ranks] == [None, None]


def test_each_ranks_actors_get_their_own_seeds():
    envs, actors = 4, 64
    seeds = [
        {actor_seed(rank_seed(run_seed, rank), actor, envs) + env for actor in range(actors) for env in range(envs)}
        for run_seed in (1, 2)
        for rank in range(4)
    ]
    assert sum(map(len, seeds)) == len(set().union(*seeds))  # no env seed twice, across ranks and run seeds
    assert rank_seed(7, 0) == 7  # rank 0 plays what a one-rank run plays


@pytest.mark.parametrize(
    ("configured", "device", "local_ranks", "gpus", "chosen"),
    [
        ("auto", "cpu", 2, 0, "gloo"),
        ("auto", "cuda", 2, 2, "nccl"),
        ("auto", "cuda", 2, 1, "gloo"),  # NCCL refuses two ranks on one GPU
        ("gloo", "cuda", 2, 2, "gloo"),
        ("nccl", "cuda", 4, 4, "nccl"),
    ],
)
def test_the_backend_follows_the_gpus_each_rank_has(configured, device, local_ranks, gpus, chosen):
    assert distributed.choose_backend(configured, torch.device(device), local_ranks, gpus) == chosen


def test_nccl_with_more_ranks_than_gpus_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="2 ranks share this machine's 1 GPU: use distributed.backend=gloo"):
        distributed.choose_backend("nccl", torch.device("cuda"), 2, 1)


def test_one_rank_runs_take_no_distributed_path(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(key, raising=False)
    cfg = learner_cfg()
    assert not distributed.wanted(cfg)
    assert distributed.follower_overrides(["seed=1"]) == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert distributed.wanted(cfg)
    assert distributed.follower_overrides(["seed=1"]) == [
        "hydra.output_subdir=null",
        "hydra/job_logging=stdout",
        "hydra.run.dir=.",
    ]


# -- end to end -------------------------------------------------------------------------------

# One actor a rank: what is tested is between the ranks.
TWO = [
    "experiment=cartpole",
    *SMALL,
    "backend.num_actors=1",
    "eval.interval_steps=0",
    "eval.final=false",
    "distributed.timeout_s=20",
]
ROW_STEPS = 2 * 4 * 16  # two ranks x batch_size x unroll_length (SMALL)


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the spawned rank `rank` of the run in run_dir."""
    out = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run_dir}"], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and f"{distributed.SPAWNED}=1".encode() in environ:
            return pid
    return None


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torchbeast_hydra", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env())


@pytest.mark.slow
def test_two_spawned_ranks_train_in_one_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, *TWO, "total_steps=2560", "distributed.nproc=2", timeout=240)
    steps = [row["step"] for row in rows(run_dir)]
    assert steps[-1] >= 2560 and set(b - a for a, b in zip(steps, steps[1:])) == {ROW_STEPS}
    assert "ranks    2 (gloo)" in (run_dir / "torchbeast.log").read_text()
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / ".hydra").is_dir()
    assert result.stdout.count("Finished:") == 1  # rank 1 says only warnings and errors


@pytest.mark.slow
def test_torchrun_two_ranks_share_one_run_dir(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "torchbeast_hydra", *TWO, "total_steps=2560"]
    env = cli_env(PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    subprocess.run(command, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=240)
    (run_dir,) = [d for d in (tmp_path / "outputs").glob("*/*") if d.is_dir()]  # one dir, not one per rank
    steps = [row["step"] for row in rows(run_dir)]
    assert steps[-1] >= 2560 and set(b - a for a, b in zip(steps, steps[1:])) == {ROW_STEPS}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_stops_the_other_with_a_line_naming_it(tmp_path, how):
    run_dir = tmp_path / "run"
    process = _start(run_dir, *TWO, "total_steps=10000000", "distributed.nproc=2")
    try:
        wait_for(lambda: (run_dir / "logs.csv").exists() and rows(run_dir), 120, "the first update")
        rank1 = _rank_pid(run_dir, 1)
        os.kill(rank1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        out, _ = process.communicate(timeout=120)
        assert time.monotonic() - started < 20 + 30  # distributed.timeout_s, and the wind-down
    finally:
        process.kill()
        if how == "hung" and _rank_pid(run_dir, 1):  # rank 0 ends it; in case it did not
            os.kill(rank1, signal.SIGKILL)
    assert process.returncode == 1
    (line,) = [line for line in out.splitlines() if "error:" in line]
    # Killed or stopped between collectives, or inside one (it had reached it: its process tells).
    inside = "error: rank 1 (died) of 2 during" if how == "killed" else "error: rank 1 (stopped) of 2 during"
    assert "error: rank 1 of 2 never reached collective" in line or inside in line
    assert "Rank 0 stops too" in line


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_all_with_one_checkpoint_and_two_ranks_resume(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*TWO, "total_steps=5120", "distributed.nproc=2"]
    process = _start(run_dir, *overrides)
    wait_for(lambda: (run_dir / "logs.csv").exists() and rows(run_dir), 120, "the first update")
    os.kill(_rank_pid(run_dir, 1), signal.SIGUSR2)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    assert out.count("Saved checkpoint") == 1 and "Stopped by SIGUSR2" in out
    stopped_at = torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"]
    assert 0 < stopped_at < 5120 and rows(run_dir)[-1]["step"] == stopped_at

    result = run_cli(run_dir, *overrides, timeout=240)
    assert f"Resuming from {run_dir / 'checkpoint.pt'} at step {stopped_at}" in result.stdout + result.stderr
    steps = [row["step"] for row in rows(run_dir)]
    assert steps == sorted(steps) and steps[-1] >= 5120
    assert set(b - a for a, b in zip(steps, steps[1:])) == {ROW_STEPS}


def test_slurm_tasks_under_submitit_give_rank_world_size_and_master(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # set, then deleted: monkeypatch restores each as it was (absent) after the test, although
        # from_environment writes them into os.environ, which would leak into later tests' CLI runs
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NTASKS="4", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu[07-08]")
    slurm.update(SLURM_NODEID="1", SLURM_PROCID="3", SLURM_LOCALID="1", SUBMITIT_EXECUTOR="slurm")
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert distributed.from_environment() == distributed.RankEnv(rank=3, world_size=4, local_rank=1, local_world_size=2)
    assert os.environ["MASTER_ADDR"] == "gpu07"  # the job's first node hosts the rendezvous
    port = os.environ["MASTER_PORT"]
    monkeypatch.delenv("RANK")  # another task of the same job (or its requeue) finds the same port
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("MASTER_PORT", port)
    assert distributed.from_environment().rank == 0 and os.environ["MASTER_PORT"] == port


def test_the_slurm_ranks_preset_runs_one_task_per_gpu():
    from hydra import compose, initialize_config_dir

    from torchbeast_hydra.__main__ import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm_ranks"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert (launcher.tasks_per_node, launcher.gpus_per_task, launcher.gpus_per_node) == (2, 1, None)
    assert launcher._target_.endswith("torchbeast_hydra_slurm.launcher.SlurmLauncher")


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_run_stopped_by_a_signal_resumes_with_another_number_of_ranks(tmp_path, before, after):
    """Resume with a different N: the weights, optimiser state, step count and episodes carry over;
    each update's rows then count `after` ranks' steps. The stop is SLURM's requeue: SIGTERM to
    every rank and every actor, which are not replaced: the ranks agree on the stop without
    waiting for a next batch that no actor is left to make."""
    run_dir = tmp_path / "run"
    overrides = [*TWO, "total_steps=12800"]
    process = _start(run_dir, *overrides, f"distributed.nproc={before}")
    wait_for(lambda: (run_dir / "logs.csv").exists() and rows(run_dir), 120, "the first update")
    ranks = [process.pid, *([_rank_pid(run_dir, 1)] if before == 2 else [])]
    actors = [actor for rank in ranks for actor in actor_pids(rank)]
    for pid in ranks + actors:
        os.kill(pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    assert out.count("Saved checkpoint") == 1 and "Stopped by SIGTERM" in out
    assert actors and "starting a replacement" not in out
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    stopped_at, episodes = saved["step"], saved["stats"]["episodes"]
    assert 0 < stopped_at < 12800 and rows(run_dir)[-1]["step"] == stopped_at

    result = run_cli(run_dir, *overrides, f"distributed.nproc={after}", timeout=240)
    out = result.stdout + result.stderr
    assert f"Resuming from {run_dir / 'checkpoint.pt'} at step {stopped_at}" in out
    assert out.count("Finished:") == 1
    assert out.count(f"Resuming a run of {before} rank(s) with {after}:") == 1  # rank 0 says so
    assert f"from {before} ranks to {after}" in (run_dir / "torchbeast.log").read_text()
    steps = [row["step"] for row in rows(run_dir)]
    assert steps == sorted(steps) and steps[-1] >= 12800
    per_update = {b - a for a, b in zip(steps, steps[1:])}
    resumed = steps.index(stopped_at) + 1
    assert {b - a for a, b in zip(steps[resumed - 1 :], steps[resumed:])} == {after * 4 * 16}
    assert per_update <= {before * 4 * 16, after * 4 * 16}
    resumed_state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert resumed_state["stats"]["episodes"] > episodes and resumed_state["ranks"] == after
