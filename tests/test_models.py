import numpy as np
import pytest
import torch

from torchbeast_hydra.config import AtariNetConfig, ConfigError, MLPConfig, ResNetConfig
from torchbeast_hydra.envs import EnvSpec
from torchbeast_hydra.models import make_model

ATARI = EnvSpec.box((4, 84, 84), np.dtype(np.uint8), 6)
VECTOR = EnvSpec.box((4,), np.dtype(np.float32), 2)


def inputs(spec, T, B, done=None):
    if spec.leaves[0].dtype == np.uint8:
        frame = torch.randint(0, 256, (T, B, *spec.obs_shape), dtype=torch.uint8)
    else:
        frame = torch.randn(T, B, *spec.obs_shape)
    return dict(
        frame=frame,
        reward=torch.randn(T, B),
        done=torch.zeros(T, B, dtype=torch.bool) if done is None else done,
        last_action=torch.randint(0, spec.num_actions, (T, B)),
    )


CONFIGS = dict(atari_net=AtariNetConfig, resnet=ResNetConfig, mlp=MLPConfig)


@pytest.mark.parametrize("name, spec", [("atari_net", ATARI), ("resnet", ATARI), ("mlp", VECTOR)])
@pytest.mark.parametrize("use_lstm", [False, True])
def test_output_shapes(name, spec, use_lstm):
    model = make_model(CONFIGS[name](use_lstm=use_lstm), spec)
    outputs, state = model(inputs(spec, 3, 2), model.initial_state(2))
    assert outputs["policy_logits"].shape == (3, 2, spec.num_actions)
    assert outputs["baseline"].shape == (3, 2)
    assert outputs["action"].shape == (3, 2)
    assert ((0 <= outputs["action"]) & (outputs["action"] < spec.num_actions)).all()
    assert len(state) == (2 if use_lstm else 0)


def test_greedy_actions_are_the_argmax():
    model = make_model(MLPConfig(), VECTOR)
    outputs, _ = model(inputs(VECTOR, 4, 3), action="greedy")
    assert torch.equal(outputs["action"], outputs["policy_logits"].argmax(-1))


def test_lstm_unroll_matches_step_by_step_with_resets():
    """The learner's pass over an unroll must see what the actor saw, one step at a time."""
    torch.manual_seed(0)
    model = make_model(MLPConfig(use_lstm=True), VECTOR)
    done = torch.zeros(6, 2, dtype=torch.bool)
    done[3, 0] = True
    x = inputs(VECTOR, 6, 2, done)
    state = tuple(torch.randn_like(s) for s in model.initial_state(2))
    whole, whole_state = model(x, state)
    stepped, step_state = [], state
    for t in range(6):
        out, step_state = model({k: v[t : t + 1] for k, v in x.items()}, step_state)
        stepped.append(out["policy_logits"])
    assert torch.allclose(whole["policy_logits"], torch.cat(stepped), atol=1e-6)
    for a, b in zip(whole_state, step_state):
        assert torch.allclose(a, b, atol=1e-6)


def test_done_resets_lstm_state():
    torch.manual_seed(0)
    model = make_model(MLPConfig(use_lstm=True), VECTOR)
    x = inputs(VECTOR, 1, 1, torch.ones(1, 1, dtype=torch.bool))
    from_noise, _ = model(x, tuple(torch.randn_like(s) for s in model.initial_state(1)))
    from_zero, _ = model(x, model.initial_state(1))
    assert torch.allclose(from_noise["policy_logits"], from_zero["policy_logits"])


@pytest.mark.parametrize("name", ["atari_net", "resnet"])
def test_image_model_on_vector_env_is_refused(name):
    with pytest.raises(ConfigError, match="model=mlp"):
        make_model(CONFIGS[name](), VECTOR)


def test_image_too_small_is_refused():
    with pytest.raises(ConfigError, match="screen_size"):
        make_model(AtariNetConfig(), EnvSpec.box((4, 20, 20), np.dtype(np.uint8), 6))


def test_sampling_from_non_finite_logits_acts_uniformly_instead_of_crashing():
    model = make_model(MLPConfig(hidden_sizes=[8]), EnvSpec.box((4,), np.dtype("float32"), 3))
    with torch.no_grad():
        model.policy.bias.fill_(float("nan"))
    inputs = dict(
        frame=torch.zeros(1, 300, 4),
        reward=torch.zeros(1, 300),
        done=torch.zeros(1, 300, dtype=torch.bool),
        last_action=torch.zeros(1, 300, dtype=torch.long),
    )
    actions = model(inputs)[0]["action"]
    assert set(actions.flatten().tolist()) == {0, 1, 2}


def test_model_configs_saved_before_target_still_build_the_same_network():
    from torchbeast_hydra.models import saved_model_config

    old = dict(name="mlp", use_lstm=True, hidden_sizes=[8])  # a checkpoint's model config before _target_
    model = make_model(saved_model_config(old), VECTOR)
    assert model.use_lstm and model.body.output_size == 8
    assert (
        make_model(saved_model_config(dict(name="atari_net", use_lstm=True, hidden_sizes=[64])), ATARI).lstm.num_layers
        == 2
    )


def test_atari_net_starts_orthogonal_and_the_policy_near_uniform():
    torch.manual_seed(0)
    model = make_model(AtariNetConfig(), ATARI)
    for layer in (model.body.convs[0], model.body.fc):
        weight = layer.weight.detach().flatten(1)  # rows: output units
        rows = weight @ weight.T if weight.shape[0] <= weight.shape[1] else weight.T @ weight
        assert torch.allclose(rows, 2.0 * torch.eye(len(rows)), atol=1e-4)  # orthogonal, gain sqrt(2)
        assert not layer.bias.detach().any()
    outputs, _ = model(inputs(ATARI, 2, 3), action="none")
    probabilities = outputs["policy_logits"].softmax(-1)
    assert torch.allclose(probabilities, torch.full_like(probabilities, 1 / 6), atol=0.02)
