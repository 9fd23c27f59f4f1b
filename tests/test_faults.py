"""Faults injected into real runs: killed processes, a full disk, non-finite updates, a learner
restarted under its clients, many clients at once. Each asserts what a user would rely on."""

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from torchbeast_hydra.backends.poly.client import Connection, EnvClient
from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.run import checkpoint

from helpers import TINY, cli_env, descendants, rows, run_cli, running, start_cli, start_env_process, steps, wait_for

pytestmark = pytest.mark.slow


def test_learner_killed_mid_run_resumes_from_its_last_checkpoint_with_continuous_logs(tmp_path):
    run_dir = tmp_path / "run"
    first = start_cli(run_dir, *TINY, "total_steps=1000000", "checkpoint_interval_s=1")
    try:
        wait_for(lambda: checkpoint.path_in(run_dir).exists() and len(rows(run_dir)) >= 30, 90, "a checkpoint")
        helpers = descendants(first.pid)  # the actors, the evaluation process, the fork server and tracker
        first.kill()  # SIGKILL, the learner only: its actors see their pipes close and exit
        first.wait(timeout=30)
        # None outlives it (the evaluation process once did, waiting for snapshots that never came).
        wait_for(lambda: not [pid for pid in helpers if running(pid)], 20, "the killed learner's processes to exit")
    finally:
        first.kill()
    saved = checkpoint.load(checkpoint.path_in(run_dir))["step"]
    logged_before = steps(run_dir)
    assert logged_before[-1] >= saved  # rows past the checkpoint exist and must not repeat

    total = logged_before[-1] + 20 * 64  # the resumed run ends 20 updates past where the first was killed
    run_cli(run_dir, *TINY, f"total_steps={total}", "checkpoint_interval_s=1", timeout=240)
    logged = steps(run_dir)
    assert logged == list(range(64, total + 1, 64))  # no duplicate, no gap, to total_steps
    assert [s for s in logged_before if s <= saved] == [s for s in logged if s <= saved]
    print(
        f"learner SIGKILL at step {logged_before[-1]}: resumed from {saved}, "
        f"{logged_before[-1] - saved} steps redone (checkpoint_interval_s=1)"
    )


SLOW_SAVE = """
import sys, time, torch
from torchbeast_hydra.run import checkpoint
real_save = torch.save
def slow_save(obj, f, *args, **kwargs):
    f.write(b"partial bytes of a checkpoint")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
torch.save = slow_save
checkpoint.save(sys.argv[1], dict(step=2))
"""


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, dict(step=1, weights=torch.ones(3)))
    writer = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    assert checkpoint.load(path)["step"] == 1
    # The half-written temp file is not a checkpoint, and nothing mistakes it for one.
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".pt")] == ["checkpoint.pt"]


def test_unwritable_logs_are_a_clear_error_at_start(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs.csv").mkdir(parents=True)  # (as root, permissions would not stop us)
    result = run_cli(run_dir, *TINY, check=False)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert f"cannot write {run_dir / 'logs.csv'}: Is a directory" in output and "Traceback" not in output
    assert not checkpoint.path_in(run_dir).exists()


def test_full_disk_at_a_checkpoint_stops_clearly_and_leaves_no_partial_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".checkpoint.pt.tmp").symlink_to("/dev/full")  # where the next checkpoint is written
    result = run_cli(
        run_dir, *TINY, "backend.num_actors=1", "total_steps=100000", "checkpoint_interval_s=1", check=False
    )
    assert result.returncode == 1
    assert "No space left on device" in result.stdout + result.stderr
    assert not (run_dir / ".checkpoint.pt.tmp").exists()
    if checkpoint.path_in(run_dir).exists():  # the disk "recovered" for the final save
        logged = steps(run_dir)
        assert checkpoint.load(checkpoint.path_in(run_dir))["step"] == (logged[-1] if logged else 0)


def test_non_finite_updates_stop_the_run_when_asked_with_finite_weights_saved(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        run_dir, *TINY, "backend.num_actors=1", "optim.learning_rate=1e30", "optim.on_nonfinite=stop", check=False
    )
    assert result.returncode == 1
    assert "non-finite loss or gradient" in result.stdout + result.stderr
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert all(torch.isfinite(w).all() for w in state["learner"]["model"].values())


POLY = [*TINY, "backend=poly"]
TOKEN = "fault-token"
WITH_TOKEN = cli_env(TORCHBEAST_TOKEN=TOKEN)  # the poly processes' environment


def test_clients_wait_through_a_learner_restart_and_training_resumes(tmp_path):
    run_dir = tmp_path / "learner"
    clients = start_env_process(tmp_path / "env", run_dir, *POLY, env=WITH_TOKEN)
    learner = start_cli(run_dir, *POLY, "total_steps=200000", "backend.role=learner", env=WITH_TOKEN)
    try:
        wait_for(lambda: (run_dir / "logs.csv").exists() and len(rows(run_dir)) >= 3, 60, "training")
        learner.send_signal(signal.SIGTERM)  # e.g. preempted: it checkpoints and stops
        first_output, _ = learner.communicate(timeout=60)
        stopped_at = checkpoint.load(checkpoint.path_in(run_dir))["step"]
        time.sleep(2)
        assert clients.poll() is None, "clients must wait for the learner, not exit"
        total = stopped_at + 20 * 64  # the restarted learner trains 20 updates more
        learner = start_cli(run_dir, *POLY, f"total_steps={total}", "backend.role=learner", env=WITH_TOKEN)
        learner_output, _ = learner.communicate(timeout=120)
        client_output, _ = clients.communicate(timeout=60)
    finally:
        learner.kill()
        clients.kill()
    assert learner.returncode == 0 and clients.returncode == 0, client_output
    assert f"Resuming from {checkpoint.path_in(run_dir)} at step {stopped_at}" in learner_output
    assert "The learner ended this client's session (training finished); exiting." in client_output
    logged = steps(run_dir)
    assert logged == sorted(set(logged)) and logged[-1] >= total
    del first_output


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_64_concurrent_clients_train_steadily_with_flat_memory(tmp_path):
    run_dir = tmp_path / "learner"
    learner = start_cli(
        run_dir,
        *POLY,
        "total_steps=100000000",
        "backend.role=learner",
        "backend.address=127.0.0.1:0",
        "backend.max_clients=64",
        env=WITH_TOKEN,
    )
    clients = []
    try:
        address_file = run_dir / "actorpool_address"
        wait_for(address_file.exists, 60, "the learner")
        env_cfg = EnvConfig(id="CartPole-v1")
        for _ in range(64):
            connection = Connection(f"file:{address_file}", TOKEN, 30, 1 << 20)
            client = EnvClient(env_cfg, connection, num_envs=1)
            thread = threading.Thread(target=client.run, daemon=True)
            thread.start()
            clients.append(thread)
        wait_for(lambda: (run_dir / "logs.csv").exists() and len(rows(run_dir)) >= 2, 90, "training")
        samples = []  # (seconds, steps, learner RSS) every 1.5 s for 12 s
        started = time.monotonic()
        while time.monotonic() - started < 12:
            time.sleep(1.5)
            samples.append((time.monotonic() - started, steps(run_dir)[-1], rss_mib(learner.pid)))
        connected = int(rows(run_dir)[-1]["connected_clients"])
    finally:
        learner.send_signal(signal.SIGTERM)
        learner.communicate(timeout=60)
    assert connected == 64
    halves = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    rates = [(h[-1][1] - h[0][1]) / (h[-1][0] - h[0][0]) for h in halves]
    print(
        f"64 clients: {rates[0]:.0f} then {rates[1]:.0f} steps/s; learner RSS "
        f"{samples[0][2]:.0f} -> {samples[-1][2]:.0f} MiB"
    )
    assert min(rates) > 0.5 * max(rates), rates  # steady throughput
    assert samples[-1][2] < 1.2 * samples[len(samples) // 2][2], samples  # memory flat, not growing


def leaf_keys(cfg, prefix=""):
    from omegaconf import DictConfig

    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            yield from leaf_keys(value, f"{path}.")
        else:
            yield path


BAD_VALUES = ["abc", "-1", "0", "1e99", "-1e-9", "[1,2]", "null", "''", "true", "{a: 1}"]


@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_config_fuzz_every_bad_value_is_refused_clearly_or_accepted(backend):
    """Every key x every bad value: composition or validation refuses it with our errors (or it is
    a value that works); never an unexpected exception."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    from torchbeast_hydra.__main__ import CONFIG_DIR
    from torchbeast_hydra.config import validate
    from torchbeast_hydra.errors import ConfigError

    base = [f"backend={backend}"]
    tried = refused = 0
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        keys = list(leaf_keys(compose(config_name="config", overrides=base)))
        cases = [(key, value) for key in keys for value in BAD_VALUES]
        for key, value in random.Random(0).sample(cases, 120):  # Hydra composes ~10/s: a sample
            tried += 1
            try:
                validate(compose(config_name="config", overrides=[*base, f"{key}={value}"]))
            except (ConfigCompositionException, OmegaConfBaseException, ConfigError):
                refused += 1
    print(f"config fuzz ({backend}): {tried} bad overrides tried, {refused} refused, the rest valid values")
    assert refused > tried // 2, (tried, refused)
