"""The ActorPool server in shard processes (backends/poly/shards.py): two shards on one port, the
token and the wire's refusals in each, partial rollouts through a shard's shared slots, a shard
killed mid-run replaced (or the run stopped, once restarts run out), never a hang."""

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from torchbeast_hydra.backends.poly.rollouts import RolloutQueue
from torchbeast_hydra.backends.poly.server import ServerSettings
from torchbeast_hydra.backends.poly.shards import PORT, ShardedServer, ShardPlan

from helpers import POOL_SPEC, POOL_TOKEN, RawClient, zero_policy
from helpers import pool_hello as hello
from helpers import pool_step as step

SPEC = POOL_SPEC
pytestmark = pytest.mark.slow  # shard processes start (spawned, as in training)
T, CHUNK = 5, 2
# A connection of its own for each client, as separate processes have (gRPC shares them in-process).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def plan(max_clients=8, idle_timeout_s=30.0) -> ShardPlan:
    settings = ServerSettings(
        env_id="Test-v0",
        unroll_length=T,
        chunk_size=CHUNK,
        cut_at_reset=True,
        seed=1,
        max_envs_per_client=4,
        max_clients=max_clients,
        client_idle_timeout_s=idle_timeout_s,
    )
    return ShardPlan(
        spec=SPEC,
        settings=settings,
        token=POOL_TOKEN,
        max_message_bytes=1 << 20,
        max_batch_size=64,
        batch_timeout_s=0.001,
        initial_state=(),
    )


class Sharded:
    """Two shards on a free loopback port, zero_policy their central inference, a rollout queue."""

    def __init__(self, shards=2, max_restarts=2):
        self.errors = []
        self.rollouts = RolloutQueue(capacity=8)
        self.server = ShardedServer(
            plan(),
            shards,
            "127.0.0.1:0",
            zero_policy,
            self.rollouts,
            on_error=self.errors.append,
            max_restarts=max_restarts,
        )
        self.port = self.server.start()

    def shard_of(self, client_id: int) -> int:
        """The shard (first incarnations) that welcomed the client: ids go up in steps per start."""
        return client_id % self.server.id_step

    def stop(self):
        self.server.stop(finished=True)


@pytest.fixture
def sharded():
    served = Sharded()
    yield served
    served.stop()


def welcomed(port, token=POOL_TOKEN):
    """(client, its id) once welcomed."""
    client = RawClient(port, token, OWN_CONNECTION)
    client.outgoing.put(hello())
    message = next(client.responses)
    assert message.WhichOneof("kind") == "welcome"
    return client, message.welcome.client_id


def until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_two_shards_serve_remote_clients_on_one_port_and_each_refuses_what_the_wire_refuses(sharded):
    # The kernel spreads connections over the shards; clients come until both have served one.
    served, refused = set(), set()
    for _ in range(60):
        client, client_id = welcomed(sharded.port)
        assert client.send(step(frame=1.0)) == "actions"
        served.add(sharded.shard_of(client_id))
        client.outgoing.put(step(frame=np.nan))  # refused by whichever shard serves it
        error = client.error()
        client.close()
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "frame has non-finite values (NaN/inf) for envs [0, 1]" in error.details()
        refused.add(sharded.shard_of(client_id))
        if len(served) == len(refused) == 2:
            break
    assert served == refused == {0, 1}
    # Without the token every shard turns the stream away before its hello.
    for _ in range(6):
        stranger = RawClient(sharded.port, "wrong", OWN_CONNECTION)
        stranger.outgoing.put(hello())
        assert stranger.error().code() == grpc.StatusCode.UNAUTHENTICATED
        stranger.close()
    assert not sharded.errors


def test_partial_rollouts_come_through_a_shards_slots_and_slots_are_reused(sharded):
    # More chunks than a shard has slots: each comes back to the shard once the learner is done with it
    # (a batch that is one whole slot is lent until the next get_batch, others are copied out).
    for _ in range(12):
        client, _ = welcomed(sharded.port)
        for i in range(2):
            assert client.send(step(frame=float(i + 1))) == "actions"
        client.close()  # leaving: its two envs' unrolls, two steps each, are handed on partial
        batch, core_state = sharded.rollouts.get_batch(CHUNK, lambda: False)
        assert batch["mask"].shape == (T + 1, CHUNK)
        assert batch["mask"].sum(0).tolist() == [2, 2]  # the two steps, padded to T
        assert batch["frame"][:2, :, 0].tolist() == [[1.0, 1.0], [2.0, 2.0]]
        assert core_state == ()


def test_a_shard_killed_mid_run_is_replaced_and_its_clients_reconnect():
    sharded = Sharded(max_restarts=2)
    try:
        until(lambda: len(sharded.server.processes.processes) == 2)
        clients = []
        while len({sharded.shard_of(i) for _, i in clients}) < 2:
            client, client_id = welcomed(sharded.port)
            assert client.send(step()) == "actions"
            clients.append((client, client_id))
        victim = sharded.server.processes.processes[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        # Its clients' streams end (they would reconnect); the other shard's clients step on.
        for client, client_id in clients:
            if sharded.shard_of(client_id) == 0:
                assert client.error().code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            else:
                assert client.send(step()) == "actions"
        sharded.server.supervise(replace=True)
        assert sharded.server.processes.restarts == 1
        until(lambda: sharded.server.central.links[0].stats[PORT] == sharded.port)  # the replacement listens
        # New clients land on either shard, the replacement included, and are answered.
        seen = set()
        for _ in range(60):
            client, client_id = welcomed(sharded.port)
            assert client.send(step()) == "actions"
            client.close()
            seen.add(client_id % sharded.server.id_step)
            if 2 in seen:  # the third start: shard 0's replacement
                break
        assert 2 in seen
        for client, _ in clients:
            client.close()
        assert not sharded.errors
    finally:
        sharded.stop()


def test_a_shard_that_keeps_dying_stops_the_run_with_one_line():
    sharded = Sharded(max_restarts=0)
    try:
        victim = sharded.server.processes.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        with pytest.raises(RuntimeError) as failure:
            sharded.server.supervise(replace=True)
        assert "\n" not in str(failure.value)
    finally:
        stopper = threading.Thread(target=sharded.stop)
        stopper.start()
        stopper.join(timeout=60)
        assert not stopper.is_alive(), "stopping hung"
