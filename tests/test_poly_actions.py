"""The poly server and client with other action spaces: a Box space's actions travel as float arrays,
a client's hello must name the learner's space, its last_action leaves are checked against it (a
Box one against the bounds too), a policy's NaN action stops the run instead of reaching an env, and
a client refuses actions that do not fit its env."""

import grpc
import gymnasium as gym
import numpy as np
import pytest
import torch

from torchbeast_hydra.agent.distributions import distribution
from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.server import ServerSettings
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.actions import ActionSpec, action_spec
from torchbeast_hydra.env.spaces import EnvSpec

from helpers import RawClient, serve_pool

BOX = action_spec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "Box-v0")
SPEC = EnvSpec.box((3,), np.float32, BOX)


class Policy:
    """A Gaussian policy whose mean the test sets (NaN: a diverged policy)."""

    def __init__(self):
        self.mean = 0.5

    def __call__(self, inputs: dict) -> dict:
        n = inputs["frame"].shape[0]
        params = torch.cat([torch.full((n, 2), self.mean), torch.zeros(n, 2)], dim=1)
        return dict(
            action=distribution(BOX).sample(params),
            policy_logits=params,
            baseline=torch.zeros(n),
            policy_version=torch.zeros(n, dtype=torch.int64),
        )


@pytest.fixture
def served():
    policy = Policy()
    fatal = []  # what inference raised: the backend stops the run with it (PolyBeast._inference_failed)
    settings = ServerSettings("Box-v0", 5, 2, True, 1, 4, 2, 5.0)
    with serve_pool(SPEC, settings, policy, on_error=fatal.append) as (pool, port):
        yield pool, port, policy, fatal


def hello(actions: ActionSpec = BOX, num_envs=2):
    return wire.encode_hello(EnvSpec(SPEC.leaves, actions), "Box-v0", num_envs)


def step(last_action=0.0, num_envs=2):
    outputs = layout.env_outputs(SPEC, num_envs)
    outputs["done"][:] = False
    outputs["last_action"][:] = last_action
    return wire.encode_step(outputs)


def test_box_actions_travel_as_float_arrays_unclipped(served):
    _, port, policy, _ = served
    policy.mean = 5.0  # beyond the bound: the client clips, the wire carries the sample
    client = RawClient(port)
    assert client.send(hello()) == "welcome"
    client.outgoing.put(step(last_action=1.0))  # the action the env took: clipped to the bound
    message = next(client.responses)
    actions = wire.decode_actions(message.actions, 2, BOX)
    client.close()
    assert actions.dtype == np.float32 and actions.shape == (2, 2) and (actions > 1.0).any()


def test_a_client_with_another_action_space_is_refused_naming_both(served):
    _, port, _, _ = served
    client = RawClient(port)
    client.outgoing.put(hello(actions=ActionSpec.discrete(2)))
    error = client.error()
    client.close()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert '"kind": "discrete"' in error.details() and '"kind": "box"' in error.details()


def test_non_finite_last_actions_are_refused(served):
    pool, port, _, _ = served
    client = RawClient(port)
    assert client.send(hello()) == "welcome"
    client.outgoing.put(step(last_action=np.nan))
    error = client.error()
    client.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "last_action are not finite (NaN/inf) for envs [0, 1]" in error.details()


def test_box_last_actions_outside_the_bounds_are_refused_and_a_good_client_goes_on(served):
    pool, port, _, fatal = served
    good = RawClient(port)
    assert good.send(hello()) == "welcome" and good.send(step()) == "actions"
    bad = RawClient(port)
    assert bad.send(hello()) == "welcome"
    bad.outgoing.put(step(last_action=np.array([[0.5, -1.0], [3e38, 0.0]])))  # finite, far past [-1, 1]
    error = bad.error()
    bad.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "last_action outside the action space Box([2], [-1, 1]) for envs [1]" in error.details()
    assert good.send(step(last_action=-1.0)) == "actions"
    good.close()
    assert pool.rejected == 1 and not fatal


def test_a_policy_that_produces_nan_actions_stops_the_run_before_any_env_sees_them(served):
    _, port, policy, fatal = served
    client = RawClient(port)
    assert client.send(hello()) == "welcome" and client.send(step()) == "actions"
    policy.mean = float("nan")
    client.outgoing.put(step())
    error = client.error()
    client.close()
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "the learner stopped" in error.details()
    assert len(fatal) == 1 and "non-finite Box action" in str(fatal[0]), "no action reached the env"


@pytest.mark.parametrize(
    "actions, spec, message",
    [
        (np.array([[0.1, np.nan]], np.float32), BOX, "not finite"),
        (np.array([[0.1, 0.2]], np.float64), BOX, r"expected float32 \[1, 2\]"),
        (np.array([[2, 0]]), action_spec(gym.spaces.MultiDiscrete([2, 2]), "M-v0"), "outside the action space"),
    ],
)
def test_a_client_checks_the_actions_it_is_sent_against_its_space(actions, spec, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_actions(wire.encode_array(actions), 1, spec)
