"""End-to-end runs of the poly backend on loopback: one process, learner + env processes,
a killed client, and hostile clients (no token, malformed messages) while training goes on."""

import os
import signal
import socket

import grpc
import numpy as np
import pytest

from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.run import checkpoint

from helpers import REPO, TINY, actor_pids, cli_env, rows, run_cli, start_cli, start_env_process, steps, wait_for

POLY_TINY = [*TINY, "backend=poly"]
TOKEN = "test-token-123"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ["shared_memory", "grpc"])
def test_role_all_trains_logs_checkpoints_and_test_mode_plays_it(tmp_path, transport):
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, *POLY_TINY, f"backend.local_transport={transport}")
    logged = rows(run_dir)
    assert int(logged[-1]["step"]) >= 2560
    assert steps(run_dir) == sorted(set(steps(run_dir)))
    # Central inference batched the clients' envs; both clients were connected.
    assert max(float(row["inference_batch_size"] or 0) for row in logged) >= 2
    assert max(int(row["connected_clients"]) for row in logged) == 2
    assert all(row["learner_queue_size"] is not None for row in logged)
    assert any(float(row["inference_host_us_per_step"] or 0) > 0 for row in logged)
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert state["step"] == int(logged[-1]["step"]) and state["config"]["backend"]["name"] == "poly"
    output = result.stderr + result.stdout
    if transport == "grpc":
        assert output.count(" connected from ") == 2
        assert "The learner ended this client's session (training finished); exiting." in output
    else:
        assert output.count(" connected over shared memory with ") == 2

    played = run_cli(tmp_path / "test", "mode=test", f"load_dir={run_dir}", "test.num_episodes=2")
    assert "Mean return over 2 episodes" in played.stdout


@pytest.mark.parametrize("transport", ["shared_memory", "grpc"])
def test_role_all_with_two_server_shards_trains_and_finishes(tmp_path, transport):
    run_dir = tmp_path / "run"
    result = run_cli(
        run_dir,
        *POLY_TINY,
        f"backend.local_transport={transport}",
        "backend.server_shards=2",
        "backend.gil_switch_interval_ms=0.5",
    )
    logged = rows(run_dir)
    assert int(logged[-1]["step"]) >= 2560
    assert steps(run_dir) == sorted(set(steps(run_dir)))
    assert max(int(row["connected_clients"]) for row in logged) == 2
    assert any(row["server_us_per_step"] for row in logged)
    assert any(float(row["inference_host_us_per_step"] or 0) > 0 for row in logged)  # the central server's
    output = result.stderr + result.stdout
    assert "in 2 shard processes" in output and "GIL switch interval 0.5 ms" in output
    if transport == "grpc":
        assert output.count(" connected from ") == 2
    else:  # one client in each shard
        assert "[shard 0][INFO] - Client" in output and "[shard 1][INFO] - Client" in output


def test_killed_client_leaves_partial_rollouts_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    log_file = run_dir / "torchbeast.log"

    def connections():
        return log_file.read_text().count(" connected over shared memory ") if log_file.exists() else 0

    learner = start_cli(run_dir, *POLY_TINY, "total_steps=30000")
    try:
        # Kill a connected client twice (the second time once the replacement is in): a client
        # killed just after finishing an unroll has nothing unfinished, so one kill leaves a
        # partial rollout only 15 times in 16.
        for connected in (2, 3):
            wait_for(lambda n=connected: connections() >= n, 120, f"{connected} client connections")
            os.kill(actor_pids(learner.pid)[0], signal.SIGKILL)
        output, _ = learner.communicate(timeout=300)  # generous: a loaded box is slow, not wrong
    finally:
        learner.kill()
    assert learner.returncode == 0, output
    assert output.count("unfinished unrolls go to the learner as partial rollouts") == 2
    assert output.count("died with exit code -9 (SIGKILL: most often the kernel's out-of-memory killer") == 2
    assert output.count("starting a replacement") == 2
    assert steps(run_dir)[-1] >= 30000
    # Partial rollouts count their real steps only: updates are not all B*T.
    sizes = np.diff([0, *steps(run_dir)])
    assert (sizes < 64).any() and (sizes <= 64).all()


def raw_stream(port, messages, token=TOKEN):
    """Sends raw request bytes on one Connect stream; returns the responses or the RpcError."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        connect = channel.stream_stream(
            wire.CONNECT, request_serializer=None, response_deserializer=wire.ServerMessage.FromString
        )
        try:
            return list(connect(iter(messages), metadata=((wire.TOKEN_METADATA_KEY, token),), timeout=30))
        except grpc.RpcError as error:
            return error


def hello(num_envs=1, obs_shape=(4,), num_actions=2):
    return wire.encode_hello(EnvSpec.box(obs_shape, np.float32, num_actions), "CartPole-v1", num_envs)


def step(num_envs=1, frame_shape=(4,), last_action=0, frame_dtype=np.float32):
    return wire.encode_step(
        dict(
            frame=np.zeros((num_envs, *frame_shape), frame_dtype),
            reward=np.zeros(num_envs, np.float32),
            done=np.zeros(num_envs, bool),
            episode_return=np.zeros(num_envs, np.float32),
            episode_step=np.zeros(num_envs, np.int32),
            last_action=np.full(num_envs, last_action, np.int64),
            episode_end=np.zeros(num_envs, bool),
        )
    )


def test_learner_and_env_processes_with_hostile_clients(tmp_path):
    # The env process starts first and finds the learner through its address file (as array
    # jobs on a shared filesystem would); the learner picks a free port.
    env = cli_env(TORCHBEAST_TOKEN=TOKEN)
    run_dir = tmp_path / "learner"
    clients = start_env_process(tmp_path / "env", run_dir, *POLY_TINY, env=env)
    learner = start_cli(run_dir, *POLY_TINY, "total_steps=12000", "backend.role=learner", env=env)
    try:
        wait_for(lambda: (run_dir / "logs.csv").exists() and len(rows(run_dir)) >= 1, 60, "training")
        host, port = (run_dir / "actorpool_address").read_text().strip().split(":")
        assert host == "127.0.0.1"
        good = raw_stream(port, [hello(), step()])
        assert [m.WhichOneof("kind") for m in good] == ["welcome", "actions"]

        refusals = {
            "no token": (raw_stream(port, [hello()], token="wrong"), grpc.StatusCode.UNAUTHENTICATED),
            "garbage": (raw_stream(port, [hello(), b"\xff\x00garbage"]), grpc.StatusCode.INVALID_ARGUMENT),
            "shape": (raw_stream(port, [hello(), step(frame_shape=(5,))]), grpc.StatusCode.INVALID_ARGUMENT),
            "dtype": (raw_stream(port, [hello(), step(frame_dtype=np.float64)]), grpc.StatusCode.INVALID_ARGUMENT),
            "action": (raw_stream(port, [hello(), step(last_action=7)]), grpc.StatusCode.INVALID_ARGUMENT),
            "env": (
                raw_stream(port, [hello(obs_shape=(4, 84, 84), num_actions=6)]),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            "oversized": (raw_stream(port, [hello(), b"\x00" * 2_000_000]), grpc.StatusCode.RESOURCE_EXHAUSTED),
        }
        for what, (error, code) in refusals.items():
            assert isinstance(error, grpc.RpcError) and error.code() == code, (what, error)
        assert "outside the action space" in refusals["action"][0].details()
        assert "does not match the learner's CartPole-v1" in refusals["env"][0].details()

        learner_output, _ = learner.communicate(timeout=120)
        client_output, _ = clients.communicate(timeout=60)
    finally:
        learner.kill()
        clients.kill()
    assert learner.returncode == 0, learner_output
    assert clients.returncode == 0, client_output
    assert "The learner ended this client's session (training finished); exiting." in client_output
    assert learner_output.count("Refused client") == 6  # oversized never reaches our code
    assert steps(run_dir)[-1] >= 12000


def test_role_learner_without_a_token_fails_clearly(tmp_path):
    result = run_cli(
        tmp_path / "run", *POLY_TINY, "backend.role=learner", check=False, env=cli_env(TORCHBEAST_TOKEN=None)
    )
    assert result.returncode == 2
    assert "export TORCHBEAST_TOKEN" in result.stderr + result.stdout


def test_env_client_with_a_wrong_token_is_refused(tmp_path):
    port = free_port()
    env = cli_env(TORCHBEAST_TOKEN=TOKEN)
    learner = start_cli(
        tmp_path / "learner", *POLY_TINY, "backend.role=learner", f"backend.address=127.0.0.1:{port}", env=env
    )
    try:
        clients = run_cli(
            tmp_path / "env",
            *POLY_TINY,
            "backend.role=env",
            f"backend.address=127.0.0.1:{port}",
            "backend.num_actors=1",
            "backend.token=not-the-token",
            check=False,
            timeout=90,
        )
    finally:
        learner.send_signal(signal.SIGTERM)
        learner.communicate(timeout=60)
    assert clients.returncode != 0
    assert "refused this client: UNAUTHENTICATED" in clients.stderr + clients.stdout


@pytest.mark.slow
def test_local_clients_of_a_stopped_learner_say_it_was_stopped_not_finished(tmp_path):
    run_dir = tmp_path / "run"
    learner = start_cli(
        run_dir, *POLY_TINY, "total_steps=10000000", "backend.num_actors=1", "backend.local_transport=grpc"
    )
    try:
        wait_for(lambda: (run_dir / "logs.csv").exists() and len(rows(run_dir)) >= 2, 120, "training")
        learner.send_signal(signal.SIGTERM)
        output, _ = learner.communicate(timeout=120)
    finally:
        learner.kill()
    assert "the learner was stopped; its run resumes when started again" in output
    assert "(training finished)" not in output


@pytest.mark.parametrize("transport", ["shared_memory", "grpc"])
def test_a_local_client_whose_env_overflows_the_model_is_refused_and_the_run_stops_naming_it(tmp_path, transport):
    """tests/overflow_envs.py: a float64 1e300 at every episode's 5th step. A remote client would be
    dropped and training go on (test_poly_server.py); the learner's own clients all step that env."""
    overflowing = [
        *POLY_TINY,
        "backend.num_actors=1",
        "env.id=Overflowing-v0",
        "env.imports=[overflow_envs]",
        "model.normalize_obs=true",
        f"backend.local_transport={transport}",
    ]
    with_test_envs = cli_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    result = run_cli(tmp_path / "run", *overflowing, env=with_test_envs, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "frame has values beyond +-3.403e+38, the largest the model computes with, for envs [0" in output
    assert "the learner refused env client 0; see its log above." in output
