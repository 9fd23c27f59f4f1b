"""The ActorPool server in-process, with raw client streams: it stays hard against clients that
send non-finite frames, floats beyond the model's range or observation leaves that do not fit the
env's spaces, whose steps make central inference's outputs non-finite, that go silent, or that come
when it is full."""

import itertools
import logging
import threading
import time

import grpc
import gymnasium as gym
import numpy as np
import pytest
import torch

from torchbeast_hydra.agent.models import ActorCritic, MLPBody
from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.backend import BrokenModel, CentralInference
from torchbeast_hydra.backends.poly.server import MAX_DETAILS, finite_rows
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.actions import action_spec
from torchbeast_hydra.env.spaces import EnvSpec, observation_leaves

from helpers import POOL_SPEC, POOL_TOKEN, RawClient, serve_pool, serve_small_pool, zero_policy
from helpers import pool_hello as hello
from helpers import pool_step as step

SPEC = POOL_SPEC


@pytest.fixture
def served():
    """(pool, port, emitted rollouts) for a pool with max_clients=2 and a 0.5 s idle limit."""
    yield from serve_small_pool(SPEC)


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


@pytest.fixture
def served_patiently():
    """As served, with a 3 s idle limit: what must happen before the silent clients are dropped
    fits inside it on a loaded machine too (0.5 s did not, beside a training run)."""
    yield from serve_small_pool(SPEC, idle_timeout_s=3.0)


def test_silent_clients_are_dropped_so_new_ones_get_their_slots(served_patiently, caplog):
    pool, port, emitted = served_patiently
    caplog.set_level(logging.INFO, logger="torchbeast_hydra.backends.poly.server")
    silent = [RawClient(port), RawClient(port)]
    for client in silent:  # hello and two steps, then silence
        assert client.send(hello()) == "welcome"
        assert client.send(step()) == "actions" and client.send(step()) == "actions"
    # Both slots are taken: a third client is refused with the setting to raise, each time it
    # retries, but counted as no bad client and warned of once.
    for _ in range(2):
        third = RawClient(port)
        third.outgoing.put(hello())
        refused = third.error()
        third.close()
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "raise backend.max_clients" in refused.details()
    assert pool.rejected == 0 and caplog.text.count("found the learner full") == 1
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
    assert caplog.text.count("no message for 3 s (backend.client_idle_timeout_s)") == 2
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
    yield from serve_small_pool(STRUCTURED)


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
    message = wire.parse(wire.ClientMessage, wire.encode_step(structured_outputs(), STRUCTURED.leaf_keys))
    message.step.obs.add().CopyFrom(next(array for array in message.step.obs if array.name == key))
    return message.SerializeToString()


BAD_LEAVES = {
    "missing": (wire.encode_step(without("obs/speed"), STRUCTURED.leaf_keys[:-1]), "missing ['obs/speed']"),
    "extra": (
        wire.encode_step(dict(structured_outputs(), **{"obs/x": np.zeros(2)}), (*STRUCTURED.leaf_keys, "obs/x")),
        "extra ['obs/x']",
    ),
    "frame": (wire.encode_step(dict(structured_outputs(), frame=np.zeros((2, 3), np.float32))), "extra observation"),
    "dtype": (
        wire.encode_step(with_leaf("obs/glyphs", np.zeros((2, 2, 3), np.int32)), STRUCTURED.leaf_keys),
        "obs/glyphs: expected int16 [2, 2, 3], got int32",
    ),
    "shape": (
        wire.encode_step(with_leaf("obs/glyphs", np.zeros((2, 3, 2), np.int16)), STRUCTURED.leaf_keys),
        "obs/glyphs: expected int16 [2, 2, 3], got int16 [2, 3, 2]",
    ),
    "discrete": (
        wire.encode_step(with_leaf("obs/pos", np.array([1, 0])), STRUCTURED.leaf_keys),
        "obs/pos is outside Discrete(4, start=1) for envs [1]",
    ),
    "multidiscrete": (
        wire.encode_step(with_leaf("obs/inner/1", np.array([[1, 5], [0, 0]])), STRUCTURED.leaf_keys),
        "obs/inner/1 is outside MultiDiscrete([2 5]) for envs [0]",
    ),
    "multibinary": (
        wire.encode_step(with_leaf("obs/inner/0", np.array([[0, 1, 1], [0, 2, 0]], np.int8)), STRUCTURED.leaf_keys),
        "obs/inner/0 has values other than 0 and 1 for envs [1]",
    ),
    "integer box": (  # ids that index an embedding (NetHack's glyphs): a bad one would stop the learner
        wire.encode_step(
            with_leaf("obs/glyphs", np.array([[[0, 1, 2], [3, 4, 5]], [[0, 0, 0], [0, 101, 0]]], np.int16)),
            STRUCTURED.leaf_keys,
        ),
        "obs/glyphs is outside Box(0, 100, (2, 3), int16) for envs [1]",
    ),
    "sent twice": (sent_twice("obs/pos"), "sent twice ['obs/pos']"),
    "non-finite": (
        wire.encode_step(with_leaf("obs/speed", np.array([[0, np.nan], [0, 0]], np.float32)), STRUCTURED.leaf_keys),
        "obs/speed has non-finite values (NaN/inf) for envs [0]",
    ),
}


@pytest.mark.parametrize("what", BAD_LEAVES)
def test_a_client_with_a_bad_leaf_is_refused_naming_it_and_good_clients_go_on(served_structured, what):
    pool, port, emitted = served_structured
    good = RawClient(port)
    assert good.send(hello(spec=STRUCTURED)) == "welcome"
    assert good.send(wire.encode_step(structured_outputs(), STRUCTURED.leaf_keys)) == "actions"
    raw, reason = BAD_LEAVES[what]
    bad = RawClient(port)
    assert bad.send(hello(spec=STRUCTURED)) == "welcome"
    bad.outgoing.put(raw)
    error = bad.error()
    bad.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in error.details(), error.details()
    for _ in range(6):  # past an unroll: the good client's rollout reaches the learner
        assert good.send(wire.encode_step(structured_outputs(), STRUCTURED.leaf_keys)) == "actions"
    good.close()
    assert pool.rejected == 1 and emitted and set(STRUCTURED.leaf_keys) <= set(emitted[0])
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


# -- what the model cannot compute with: a client's extreme floats, NaN out of central inference --

# InvertedPendulum-v5's spaces: float64 observations, Box actions in [-3, 3].
PENDULUM = EnvSpec.box((4,), np.float64, action_spec(gym.spaces.Box(-3.0, 3.0, (1,), np.float32), "Pendulum"))
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the model computes in float32


def mlp_policy(normalize_obs=False) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(MLPBody(PENDULUM.obs_shape, (16,), normalize_obs), PENDULUM.actions, use_lstm=False).eval()


def serve_model(policy: ActorCritic):
    """(pool, port, emitted rollouts, errors that stop the run) for a pool whose central inference runs policy."""
    fatal = []
    central = CentralInference(policy, threading.Lock(), publisher=None, device=torch.device("cpu"))
    for pool, port, emitted in serve_small_pool(PENDULUM, central, fatal.append):
        yield pool, port, emitted, fatal


@pytest.fixture
def pendulum():
    policy = mlp_policy()
    for served in serve_model(policy):
        yield (*served, policy)


def pendulum_step(frame=1.0) -> bytes:
    return step(frame=frame, spec=PENDULUM)


def connected(port) -> RawClient:
    client = RawClient(port)
    assert client.send(hello(spec=PENDULUM)) == "welcome"
    return client


def refusal(client: RawClient) -> grpc.RpcError:
    error = client.error()
    client.close()
    return error


def settle(pool) -> None:
    """Waits for every stream's end (their unfinished unrolls handed on or discarded)."""
    deadline = time.monotonic() + 10
    while pool.connected and time.monotonic() < deadline:
        time.sleep(0.02)


def frames_learned_from(emitted) -> set:
    return {value for rollouts in emitted for value in rollouts["frame"][rollouts["mask"]].flatten().tolist()}


def test_a_float64_leaf_beyond_float32s_range_is_refused_and_a_good_client_trains_on(pendulum):
    pool, port, emitted, fatal, _ = pendulum
    good = connected(port)
    assert good.send(pendulum_step()) == "actions"
    bad = connected(port)
    assert bad.send(pendulum_step(5.0)) == "actions"
    bad.outgoing.put(pendulum_step(np.array([[0, 0, 0, 0], [0, 1e300, 0, 0]])))  # finite in float64
    error = refusal(bad)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"frame has values beyond +-{FLOAT32_MAX:.4g}, the largest the model computes with, for envs [1]" in (
        error.details()
    )
    for _ in range(6):  # past an unroll
        assert good.send(pendulum_step()) == "actions"
    good.close()
    settle(pool)
    assert pool.rejected == 1 and not fatal
    assert frames_learned_from(emitted) == {1.0}, "the refused client's steps never reach the learner"


def test_nan_from_inference_for_one_clients_envs_drops_that_client_and_the_others_train_on(pendulum):
    pool, port, emitted, fatal, policy = pendulum
    with torch.no_grad():  # a first layer that adds up its inputs
        policy.body.layers[1].weight.fill_(0.5)
    good, bad = connected(port), connected(port)
    for _ in range(5):  # the bad client's next step ends its envs' unrolls
        assert bad.send(pendulum_step(5.0)) == "actions" and good.send(pendulum_step()) == "actions"
    # The largest float32: the wire takes it, the first layer's sum overflows and NaN follows.
    bad.outgoing.put(pendulum_step(np.array([[FLOAT32_MAX] * 4, [0] * 4])))
    error = refusal(bad)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "central inference gave non-finite outputs (NaN/inf) for envs [0] of this client" in error.details()
    for _ in range(6):
        assert good.send(pendulum_step()) == "actions"
    good.close()
    settle(pool)
    assert pool.rejected == 1 and not fatal, "the model is sound: the run goes on"
    assert frames_learned_from(emitted) == {1.0}, "none of the dropped client's unrolls reach the learner"


def test_a_model_with_non_finite_weights_stops_the_run_naming_them(pendulum):
    _, port, _, fatal, policy = pendulum
    client = connected(port)
    assert client.send(pendulum_step()) == "actions"
    with torch.no_grad():
        policy.baseline.bias.fill_(float("nan"))
    client.outgoing.put(pendulum_step())
    assert refusal(client).code() == grpc.StatusCode.UNAVAILABLE  # the learner stops
    assert len(fatal) == 1 and isinstance(fatal[0], BrokenModel)
    assert "the model's weights are not finite (baseline.bias); no client caused it" in str(fatal[0])


def test_central_inference_keeps_a_copy_of_a_batch_it_answered_in_full_not_the_clients_memory(monkeypatch):
    """A local client's batch is a view of its shared memory, which its next step overwrites: what
    central inference keeps to test the model again is a copy, taken at most once a second."""
    central = CentralInference(mlp_policy(), threading.Lock(), publisher=None, device=torch.device("cpu"))
    inputs = {
        "frame": torch.ones(2, *PENDULUM.obs_shape),
        "reward": torch.zeros(2),
        "done": torch.zeros(2, dtype=torch.bool),
        "last_action": torch.zeros(2, *PENDULUM.actions.step_shape),
    }
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    central(inputs)
    inputs["frame"].fill_(7.0)  # the client's next step, written where the last one was
    assert central.answered["frame"].eq(1.0).all()
    clock[0] += 0.5
    central(inputs)
    assert central.answered["frame"].eq(1.0).all(), "within the second: no new copy"
    clock[0] += 0.6
    central(inputs)
    assert central.answered["frame"].eq(7.0).all()


def test_a_model_whose_outputs_overflow_for_every_env_stops_the_run(pendulum):
    _, port, _, fatal, policy = pendulum
    client = connected(port)
    assert client.send(pendulum_step()) == "actions"
    with torch.no_grad():  # finite weights, but a baseline beyond float32 for any features
        policy.baseline.weight.fill_(FLOAT32_MAX)
        policy.baseline.bias.fill_(FLOAT32_MAX)
    client.outgoing.put(pendulum_step())
    assert refusal(client).code() == grpc.StatusCode.UNAVAILABLE
    assert len(fatal) == 1 and isinstance(fatal[0], BrokenModel)
    assert "outputs are not finite for any of a batch's 2 envs, nor now for a recent batch it answered" in str(fatal[0])


def test_observation_statistics_learn_from_validated_steps_only():
    served = serve_model(mlp_policy(normalize_obs=True))
    pool, port, emitted, fatal = next(served)
    good = connected(port)
    for bad_value in (1e300, np.nan):  # after steps the wire took
        bad = connected(port)
        for _ in range(4):
            assert good.send(pendulum_step()) == "actions" and bad.send(pendulum_step(5.0)) == "actions"
        bad.outgoing.put(pendulum_step(bad_value))
        assert refusal(bad).code() == grpc.StatusCode.INVALID_ARGUMENT
    for _ in range(6):
        assert good.send(pendulum_step()) == "actions"
    good.close()
    settle(pool)
    next(served, None)  # stops the server
    assert pool.rejected == 2 and not fatal
    learner = mlp_policy(normalize_obs=True).train()
    for rollouts in emitted:  # the learner's pass, which updates the running statistics
        learner(rollouts, (), action="none")
    norm = learner.body.normalize
    assert norm.count > 0 and norm.mean.tolist() == [1.0] * 4 and norm.var.tolist() == [0.0] * 4


def test_finite_rows_names_each_env_with_a_non_finite_float_output():
    outputs = dict(
        action=np.array([0, 1, 2, 3]),  # integers are never checked
        policy_logits=np.zeros((4, 3), np.float32),
        baseline=np.zeros(4, np.float32),
    )
    assert finite_rows(outputs).tolist() == [True] * 4
    outputs["policy_logits"][1, 2] = np.nan
    outputs["baseline"][3] = -np.inf
    assert finite_rows(outputs).tolist() == [True, False, True, False]


# -- one event loop serves every stream: none waits on another ------------------------------------


def test_every_stream_is_served_on_the_processs_one_serving_loop(served, monkeypatch):
    from torchbeast_hydra.backends.poly import serving
    from torchbeast_hydra.backends.poly.server import Session

    _, port, _ = served
    threads = set()
    step_async = Session.step_async

    async def recording(self, *args):
        threads.add(threading.get_ident())
        return await step_async(self, *args)

    monkeypatch.setattr(Session, "step_async", recording)
    clients = [RawClient(port), RawClient(port)]
    for client in clients:
        assert client.send(hello()) == "welcome"
    for _ in range(3):
        for client in clients:
            assert client.send(step()) == "actions"
    for client in clients:
        client.close()
    assert threads == {serving.loop_thread().ident}


def test_a_client_that_stops_reading_holds_up_no_other(served_patiently):
    pool, port, _ = served_patiently
    # Its replies fill its small receive window, so the server's write to it waits: on the serving
    # loop that wait must be the stream's own, while the other streams' steps are answered.
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])
    connect = channel.stream_stream(wire.CONNECT, request_serializer=None, response_deserializer=None)
    requests = itertools.chain([hello(num_envs=4)], itertools.repeat(step(num_envs=4)))
    stalled = connect(requests, metadata=((wire.TOKEN_METADATA_KEY, POOL_TOKEN),))
    deadline = time.monotonic() + 60
    while not any(time.monotonic() - s.waiting_since > 0.3 for s in list(pool._streams)):  # its write waits
        assert time.monotonic() < deadline and not pool.dropped
        time.sleep(0.02)
    reader = RawClient(port)
    assert reader.send(hello()) == "welcome"
    for _ in range(5):
        assert reader.send(step()) == "actions"
    assert pool.dropped == 0  # answered while the stalled stream still waited (3 s before it is dropped)
    reader.close()
    stalled.cancel()
    channel.close()


def test_synchronous_streams_wait_for_newer_weights_off_the_serving_loop():
    """backend.synchronous over gRPC: at an unroll's end each stream waits for newer weights on a
    thread of its own, while the serving loop goes on answering."""
    from torchbeast_hydra.backends.poly.server import ServerSettings
    from torchbeast_hydra.backends.poly.serving import loop_thread

    waiting, release = [], threading.Event()

    def newer_weights(version):
        waiting.append(threading.get_ident())
        assert release.wait(10)

    settings = ServerSettings("Test-v0", 5, 2, True, 1, 4, 2, 30.0)
    try:
        with serve_pool(SPEC, settings, zero_policy, newer_weights=newer_weights) as (pool, port):
            clients = [RawClient(port), RawClient(port)]
            for client in clients:
                assert client.send(hello()) == "welcome"
                for _ in range(5):  # row 0 and the unroll's first 4 steps
                    assert client.send(step()) == "actions"
                client.outgoing.put(step())  # its unroll's last step: it waits for newer weights
            deadline = time.monotonic() + 10
            while len(waiting) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(set(waiting)) == 2 and loop_thread().ident not in waiting  # both at once, off the loop
            release.set()
            for client in clients:
                assert next(client.responses).WhichOneof("kind") == "actions"
                client.close()
    finally:
        release.set()  # a failed assertion above must not leave the pool's threads waiting
