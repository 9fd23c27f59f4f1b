"""The ActorPool server in-process, with raw client streams: it stays hard against clients that
send non-finite frames or observation leaves that do not fit the env's spaces, go silent, or come
when it is full."""

import itertools
import logging
import time

import grpc
import gymnasium as gym
import numpy as np
import pytest
import torch

from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.server import MAX_DETAILS, ServerSettings
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.spaces import EnvSpec, observation_leaves

from helpers import POOL_TOKEN, RawClient, serve_pool

SPEC = EnvSpec.box((3,), np.dtype(np.float32), 2)


def trivial_policy(inputs: dict) -> dict:
    n = inputs["done"].shape[0]
    return dict(
        action=torch.zeros(n, dtype=torch.int64),
        policy_logits=torch.zeros(n, SPEC.actions.num_params),
        baseline=torch.zeros(n),
    )


@pytest.fixture
def served():
    """(pool, port, emitted rollouts) for a pool with max_clients=2 and a 0.5 s idle limit."""
    yield from serve(SPEC)


def serve(spec: EnvSpec):
    emitted = []
    settings = ServerSettings(
        env_id="Test-v0",
        unroll_length=5,
        chunk_size=2,
        cut_at_reset=True,
        seed=1,
        max_envs_per_client=4,
        max_clients=2,
        client_idle_timeout_s=0.5,
    )
    with serve_pool(spec, settings, trivial_policy, emit=lambda rollout, state: emitted.append(rollout)) as served:
        yield (*served, emitted)


def hello(num_envs=2, spec=SPEC):
    return wire.encode_hello(spec, "Test-v0", num_envs)


def step(num_envs=2, frame=0.0):
    outputs = layout.env_outputs(SPEC, num_envs)
    outputs["frame"][:] = frame
    outputs["done"][:] = False
    return wire.encode_step(outputs)


def test_non_finite_frames_are_refused_and_the_server_keeps_serving(served):
    pool, port, _ = served
    for bad in (np.nan, np.inf, -np.inf):
        client = RawClient(port)
        assert client.send(hello()) == "welcome"
        client.outgoing.put(step(frame=bad))
        error = client.error()
        client.close()
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "frame has non-finite values (NaN/inf) for envs [0, 1]" in error.details()
    good = RawClient(port)
    assert good.send(hello()) == "welcome" and good.send(step(frame=1.5)) == "actions"
    good.close()
    assert pool.rejected == 3


def test_silent_clients_are_dropped_so_new_ones_get_their_slots(served, caplog):
    pool, port, emitted = served
    caplog.set_level(logging.INFO, logger="torchbeast_hydra.backends.poly.server")
    silent = [RawClient(port), RawClient(port)]
    for client in silent:  # hello and two steps, then silence
        assert client.send(hello()) == "welcome"
        assert client.send(step()) == "actions" and client.send(step()) == "actions"
    # Both slots are taken: a third client is refused with the setting to raise.
    third = RawClient(port)
    third.outgoing.put(hello())
    refused = third.error()
    third.close()
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "raise backend.max_clients" in refused.details()
    # After the idle limit the silent streams are dropped; their unrolls go on as partial rollouts.
    for client in silent:
        assert client.error().code() == grpc.StatusCode.CANCELLED
        client.close()
    deadline = time.monotonic() + 10
    while (pool.connected or len(emitted) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.connected == 0 and pool.dropped == 2
    # One chunk of two envs per client, each with two real steps after row 0.
    assert [r["mask"].sum(0).tolist() for r in emitted] == [[2, 2], [2, 2]]
    assert caplog.text.count("no message for 0.5 s (backend.client_idle_timeout_s)") == 2
    newcomer = RawClient(port)
    assert newcomer.send(hello()) == "welcome" and newcomer.send(step()) == "actions"
    newcomer.close()


def test_a_client_that_sends_but_stops_reading_is_dropped_too(served):
    pool, port, _ = served
    # Without BDP probing the client's receive window stays small, so unread replies soon fill it
    # and the server's send blocks: the slot must not stay taken by a stream that looks alive.
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])
    connect = channel.stream_stream(wire.CONNECT, request_serializer=None, response_deserializer=None)
    requests = itertools.chain([hello(num_envs=4)], itertools.repeat(step(num_envs=4)))  # until the server stalls
    responses = connect(requests, metadata=((wire.TOKEN_METADATA_KEY, POOL_TOKEN),))
    deadline = time.monotonic() + 60
    while not pool.dropped and time.monotonic() < deadline:
        time.sleep(0.05)
    responses.cancel()
    channel.close()
    assert pool.dropped == 1


def test_a_client_that_never_says_hello_is_dropped_too(served):
    pool, port, _ = served
    mute = RawClient(port)
    error = mute.error()
    mute.close()
    assert error.code() == grpc.StatusCode.CANCELLED and pool.dropped == 1


# -- Dict/Tuple observations: every leaf a client sends is checked -------------------------------

STRUCTURED_SPACE = gym.spaces.Dict(
    {
        "glyphs": gym.spaces.Box(0, 100, (2, 3), np.int16),
        "pos": gym.spaces.Discrete(4, start=1),
        "inner": gym.spaces.Tuple((gym.spaces.MultiBinary(3), gym.spaces.MultiDiscrete([2, 5]))),
        "speed": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
    }
)
STRUCTURED = EnvSpec(observation_leaves(STRUCTURED_SPACE), 2)


@pytest.fixture
def served_structured():
    yield from serve(STRUCTURED)


def structured_outputs(num_envs=2) -> dict:
    outputs = layout.env_outputs(STRUCTURED, num_envs)
    outputs["obs/pos"][:] = 1
    outputs["obs/inner/1"][:] = [1, 4]
    outputs["done"][:] = False
    return outputs


def with_leaf(key, value) -> dict:
    outputs = structured_outputs()
    outputs[key] = np.asarray(value)
    return outputs


def without(key) -> dict:
    outputs = structured_outputs()
    del outputs[key]
    return outputs


def sent_twice(key: str) -> bytes:
    """A good step with one leaf's array sent a second time."""
    message = wire.parse(wire.ClientMessage, wire.encode_step(structured_outputs(), STRUCTURED.obs_keys))
    message.step.obs.add().CopyFrom(next(array for array in message.step.obs if array.name == key))
    return message.SerializeToString()


BAD_LEAVES = {
    "missing": (wire.encode_step(without("obs/speed"), STRUCTURED.obs_keys[:-1]), "missing ['obs/speed']"),
    "extra": (
        wire.encode_step(dict(structured_outputs(), **{"obs/x": np.zeros(2)}), (*STRUCTURED.obs_keys, "obs/x")),
        "extra ['obs/x']",
    ),
    "frame": (wire.encode_step(dict(structured_outputs(), frame=np.zeros((2, 3), np.float32))), "extra observation"),
    "dtype": (
        wire.encode_step(with_leaf("obs/glyphs", np.zeros((2, 2, 3), np.int32)), STRUCTURED.obs_keys),
        "obs/glyphs: expected int16 [2, 2, 3], got int32",
    ),
    "shape": (
        wire.encode_step(with_leaf("obs/glyphs", np.zeros((2, 3, 2), np.int16)), STRUCTURED.obs_keys),
        "obs/glyphs: expected int16 [2, 2, 3], got int16 [2, 3, 2]",
    ),
    "discrete": (
        wire.encode_step(with_leaf("obs/pos", np.array([1, 0])), STRUCTURED.obs_keys),
        "obs/pos is outside Discrete(4, start=1) for envs [1]",
    ),
    "multidiscrete": (
        wire.encode_step(with_leaf("obs/inner/1", np.array([[1, 5], [0, 0]])), STRUCTURED.obs_keys),
        "obs/inner/1 is outside MultiDiscrete([2 5]) for envs [0]",
    ),
    "multibinary": (
        wire.encode_step(with_leaf("obs/inner/0", np.array([[0, 1, 1], [0, 2, 0]], np.int8)), STRUCTURED.obs_keys),
        "obs/inner/0 has values other than 0 and 1 for envs [1]",
    ),
    "integer box": (  # ids that index an embedding (NetHack's glyphs): a bad one would stop the learner
        wire.encode_step(
            with_leaf("obs/glyphs", np.array([[[0, 1, 2], [3, 4, 5]], [[0, 0, 0], [0, 101, 0]]], np.int16)),
            STRUCTURED.obs_keys,
        ),
        "obs/glyphs is outside Box(0, 100, (2, 3), int16) for envs [1]",
    ),
    "sent twice": (sent_twice("obs/pos"), "sent twice ['obs/pos']"),
    "non-finite": (
        wire.encode_step(with_leaf("obs/speed", np.array([[0, np.nan], [0, 0]], np.float32)), STRUCTURED.obs_keys),
        "obs/speed has non-finite values (NaN/inf) for envs [0]",
    ),
}


@pytest.mark.parametrize("what", BAD_LEAVES)
def test_a_client_with_a_bad_leaf_is_refused_naming_it_and_good_clients_go_on(served_structured, what):
    pool, port, emitted = served_structured
    good = RawClient(port)
    assert good.send(hello(spec=STRUCTURED)) == "welcome"
    assert good.send(wire.encode_step(structured_outputs(), STRUCTURED.obs_keys)) == "actions"
    raw, reason = BAD_LEAVES[what]
    bad = RawClient(port)
    assert bad.send(hello(spec=STRUCTURED)) == "welcome"
    bad.outgoing.put(raw)
    error = bad.error()
    bad.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in error.details(), error.details()
    for _ in range(6):  # past an unroll: the good client's rollout reaches the learner
        assert good.send(wire.encode_step(structured_outputs(), STRUCTURED.obs_keys)) == "actions"
    good.close()
    assert pool.rejected == 1 and emitted and set(STRUCTURED.obs_keys) <= set(emitted[0])
    assert emitted[0]["obs/inner/1"].dtype == torch.int64 and emitted[0]["obs/inner/1"][1, 0].tolist() == [1, 4]


def test_a_client_whose_leaves_differ_from_the_learners_is_refused_at_hello(served_structured):
    _, port, _ = served_structured
    other = EnvSpec(observation_leaves(gym.spaces.Dict({"glyphs": STRUCTURED_SPACE["glyphs"]})), 2)
    client = RawClient(port)
    client.outgoing.put(hello(spec=other))
    error = client.error()
    client.close()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "obs/glyphs: int16 [2, 3]}" in error.details() and "obs/pos: int64 []" in error.details()


def test_a_refusal_quoting_the_client_is_one_line_of_bounded_length(served, caplog):
    pool, port, _ = served
    message = wire.parse(wire.ClientMessage, hello(spec=STRUCTURED))  # leaves the learner's env lacks
    message.hello.env_id = "Fake-v0\nERROR forged log line " * 10_000
    client = RawClient(port)
    client.outgoing.put(message.SerializeToString())
    error = client.error()
    client.close()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error.details()
    assert details.startswith("the client's env Fake-v0\\nERROR") and "\n" not in details
    assert len(details) <= MAX_DETAILS and details.endswith("...") and pool.rejected == 1
