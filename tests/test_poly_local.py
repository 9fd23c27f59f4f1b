"""Local env clients over shared memory (backends/poly/local.py), the server's side in-process: the
test plays the client through the channel. The whole path, client processes included, runs in
test_poly.py's role=all runs (shared memory is role=all's default)."""

import logging
import multiprocessing
import threading
import time

import numpy as np
import pytest
import torch

from torchbeast_hydra.backends.poly import local
from torchbeast_hydra.backends.poly.client import FINISHED, REFUSED, SERVER_FAILED
from torchbeast_hydra.env import layout
from torchbeast_hydra.run.seeding import actor_seed

from helpers import POOL_SPEC, serve_small_pool

CTX = multiprocessing.get_context("spawn")
SPEC = POOL_SPEC


class StandIn:
    """What serve() asks of a client process: is_alive, pid and kill."""

    def __init__(self):
        self.alive, self.killed, self.pid = True, False, 4242

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.killed = True


class Client:
    """The test's side of a channel, as client_main plays it."""

    def __init__(self, pool, num_envs=2, buffers=1):
        self.channel = local.Channel(SPEC, num_envs, CTX, pool.settings.unroll_length, buffers)
        self.rows = self.channel.arrays()
        self.process = StandIn()
        client_id, _ = pool.new_client()
        self.thread = threading.Thread(target=local.serve, args=(pool, self.channel, self.process, client_id))
        self.thread.start()

    def step(self, frame=0.0, done=False) -> np.ndarray:
        """Writes a step and waits for its answer; returns the actions."""
        self.write(frame, done)
        assert self.channel.answered.acquire(timeout=10), "no answer"
        assert int(self.channel.verdict[0]) == local.RUNNING
        return self.channel.actions.numpy().copy()

    def write(self, frame=0.0, done=False) -> None:
        outputs = self.channel.step_views(self.rows)
        outputs["frame"][:] = frame
        outputs["done"][:] = done
        self.channel.stepped.release()

    def verdict(self) -> int:
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        return int(self.channel.verdict[0])


@pytest.fixture
def served():
    yield from serve_small_pool(SPEC)


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_steps_written_to_shared_memory_are_answered_and_make_unrolls(served):
    pool, _, emitted = served
    client = Client(pool)
    for t in range(11):  # row 0 and two unrolls of T=5
        assert client.step(frame=float(t)).tolist() == [0, 0]
    assert pool.connected == 1
    assert len(emitted) == 2
    # Each unroll's rows are the frames written, row 0 repeating the previous unroll's last.
    assert emitted[0]["frame"][:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert emitted[1]["frame"][:, 1, 0].tolist() == [5, 6, 7, 8, 9, 10]
    pool.stop(finished=True)
    assert client.verdict() == FINISHED
    assert pool.connected == 0


def test_a_local_clients_steps_are_written_into_the_rows_the_learner_is_lent():
    releases = []
    for pool, _, emitted in serve_small_pool(lent=releases):
        client = Client(pool, num_envs=2, buffers=3)
        for t in range(11):  # row 0 and two unrolls of T=5: each lent as the client wrote it
            client.step(frame=float(t))
        first, second = emitted
        assert first["frame"].data_ptr() == client.channel.rows[0]["frame"].data_ptr()
        assert second["frame"].data_ptr() == client.channel.rows[1]["frame"].data_ptr()
        assert first["frame"][:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
        assert second["frame"][:, 1, 0].tolist() == [5, 6, 7, 8, 9, 10]
        assert client.channel.where.tolist() == [2, 1]  # the next step goes after row 0 of the third rows
        releases[0]()  # the learner is done with the first: written again after the third
        for t in range(11, 21):
            client.step(frame=float(t))
        rows = [r["frame"] for r in client.channel.rows]
        assert emitted[2]["frame"].data_ptr() == rows[2].data_ptr()
        # The fourth was written into the first rows; with none free to go on in, it is copied out.
        assert emitted[3]["frame"][:, 0, 0].tolist() == [15, 16, 17, 18, 19, 20]
        assert rows[0][:, 0, 0].tolist() == [20, 16, 17, 18, 19, 20]  # and its row 0 now repeats row 5
        assert emitted[3]["frame"].data_ptr() not in [r.data_ptr() for r in rows]
        pool.stop(finished=True)
        assert client.verdict() == FINISHED


def test_a_local_client_with_a_non_finite_observation_is_refused_and_its_unrolls_discarded(served, caplog):
    pool, _, emitted = served
    caplog.set_level(logging.WARNING)
    client = Client(pool)
    client.step(frame=1.0)
    client.step(frame=2.0)
    client.write(frame=np.nan)
    assert client.verdict() == REFUSED  # the client exits with it: the run stops, naming the client
    assert pool.rejected == 1 and pool.connected == 0 and emitted == []
    assert "Refused client 0 (local, pid 4242): frame has non-finite values (NaN/inf) for envs [0, 1]" in caplog.text


def test_a_failure_serving_a_local_client_is_its_verdict_not_a_silent_finish(served, caplog, monkeypatch):
    pool, _, _ = served
    monkeypatch.setattr(pool, "open_session", lambda num_envs, buffers: 1 / 0)  # a bug in the learner's own code
    client = Client(pool)
    client.write()
    assert client.verdict() == SERVER_FAILED  # the client exits with it: the run stops, naming it
    assert "Serving local client 0 (pid 4242) failed." in caplog.text and "ZeroDivisionError" in caplog.text


def test_a_local_client_that_dies_leaves_its_unfinished_unrolls_as_partial_rollouts(served):
    pool, _, emitted = served
    client = Client(pool)
    for t in range(3):
        client.step(frame=float(t))
    client.process.alive = False
    client.thread.join(timeout=10)
    assert not client.thread.is_alive() and pool.connected == 0
    assert [r["mask"][:, 0].tolist() for r in emitted] == [[True, True, True, False, False, False]]


def test_a_silent_local_client_is_killed_to_be_replaced(served, caplog):
    pool, _, _ = served  # client_idle_timeout_s=0.5
    caplog.set_level(logging.WARNING)
    client = Client(pool)
    client.step()
    wait_until(lambda: client.process.killed, timeout=5)
    client.thread.join(timeout=5)
    assert "Dropped local client 0 (pid 4242): no step for 0.5 s (backend.client_idle_timeout_s)." in caplog.text


def test_local_clients_get_the_seeds_grpc_clients_would(served):
    pool, _, _ = served  # seed=1, max_envs_per_client=4
    assert [pool.new_client() for _ in range(3)] == [(i, actor_seed(1, i, 4)) for i in range(3)]


def test_the_channel_holds_every_env_key_of_the_layout_where_the_server_says():
    channel = local.Channel(SPEC, 3, CTX, unroll_length=5, buffers=2)
    expected = layout.env_outputs(SPEC, 3)
    rows = channel.arrays()
    assert len(rows) == 2 and all(rows[1][key].shape[:2] == (6, 3) for key in rows[1])
    channel.where[:] = torch.tensor([1, 4])
    views = channel.step_views(rows)
    assert sorted(views) == sorted(expected)
    for key, array in expected.items():
        assert views[key].dtype == array.dtype and views[key].shape == array.shape
        assert views[key].ctypes.data == rows[1][key][4].ctypes.data
    assert tuple(channel.actions.shape) == (3,) and int(channel.verdict[0]) == local.RUNNING
