import copy

import gymnasium as gym
import numpy as np
import pytest
import torch

from torchbeast_hydra.agent.models import RunningNorm, make_model
from torchbeast_hydra.agent.settings import AtariNetConfig, MLPConfig, ResNetConfig
from torchbeast_hydra.env.actions import action_spec
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.errors import ConfigError

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
        last_action=torch.randint(0, spec.actions.nvec[0], (T, B)),
    )


CONFIGS = dict(atari_net=AtariNetConfig, resnet=ResNetConfig, mlp=MLPConfig)


@pytest.mark.parametrize("name, spec", [("atari_net", ATARI), ("resnet", ATARI), ("mlp", VECTOR)])
@pytest.mark.parametrize("use_lstm", [False, True])
def test_output_shapes(name, spec, use_lstm):
    model = make_model(CONFIGS[name](use_lstm=use_lstm), spec)
    outputs, state = model(inputs(spec, 3, 2), model.initial_state(2))
    assert outputs["policy_logits"].shape == (3, 2, spec.actions.nvec[0])
    assert outputs["baseline"].shape == (3, 2)
    assert outputs["action"].shape == (3, 2)
    assert ((0 <= outputs["action"]) & (outputs["action"] < spec.actions.nvec[0])).all()
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
    from torchbeast_hydra.agent.models import saved_model_config

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


def test_a_copy_whose_weights_are_overwritten_skips_the_init_and_takes_the_weights_whole():
    trained = make_model(AtariNetConfig(), ATARI)
    copy = make_model(AtariNetConfig(), ATARI, initialise=False)
    fc = copy.body.fc.weight.detach()
    assert not torch.allclose(fc @ fc.T, 2.0 * torch.eye(len(fc)), atol=0.1)  # torch's default init, not orthogonal
    copy.load_state_dict(trained.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), trained.state_dict().values()))
    again = make_model(AtariNetConfig(), ATARI)  # the switch is reset: the next model is initialised
    assert torch.allclose(again.body.fc.weight @ again.body.fc.weight.T, 2.0 * torch.eye(len(fc)), atol=1e-4)


# -- other action spaces and observation normalisation ---------------------------------------------


@pytest.mark.parametrize(
    "space",
    [gym.spaces.MultiDiscrete([3, 2]), gym.spaces.MultiBinary(3), gym.spaces.Box(-2.0, 2.0, (2,), np.float32)],
    ids=["multi_discrete", "multi_binary", "box"],
)
def test_the_policy_head_and_last_action_follow_the_action_space(space):
    actions = action_spec(space, "Test-v0")
    model = make_model(MLPConfig(hidden_sizes=[8]), EnvSpec.box((4,), np.float32, actions))
    T, B = 3, 2
    last_action = torch.from_numpy(np.stack([space.sample() for _ in range(T * B)]).reshape(T, B, -1))
    inputs = dict(frame=torch.randn(T, B, 4), reward=torch.zeros(T, B), done=torch.zeros(T, B, dtype=torch.bool))
    inputs["last_action"] = last_action.float() if actions.kind == "box" else last_action.long()
    outputs, _ = model(inputs)
    assert outputs["policy_logits"].shape == (T, B, actions.num_params)
    assert outputs["action"].shape == (T, B, actions.size) and str(outputs["action"].dtype) == f"torch.{actions.dtype}"
    greedy, _ = model(inputs, action="greedy")
    if actions.kind == "box":  # the mean, and a log std of 0 (std 1) at first
        torch.testing.assert_close(greedy["action"], outputs["policy_logits"][..., :2])
        assert (outputs["policy_logits"][..., 2:] == 0).all()
    # The core sees the last action: changing it changes the policy.
    other = dict(inputs, last_action=torch.zeros_like(inputs["last_action"]) + (0.5 if actions.kind == "box" else 0))
    assert not torch.equal(model(other, action="none")[0]["baseline"], outputs["baseline"])


@pytest.mark.parametrize("separate_critic", [False, True])
def test_without_feedback_the_heads_see_the_observation_alone(separate_critic):
    torch.manual_seed(0)
    spec = EnvSpec.box((4,), np.float32, action_spec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "Test-v0"))
    model = make_model(MLPConfig(hidden_sizes=[8], feedback=False, separate_critic=separate_critic), spec)
    assert model.baseline.in_features == 8
    T, B = 3, 2
    step = dict(frame=torch.randn(T, B, 4), done=torch.zeros(T, B, dtype=torch.bool))
    quiet = dict(step, reward=torch.zeros(T, B), last_action=torch.zeros(T, B, 2))
    loud = dict(step, reward=torch.ones(T, B), last_action=torch.full((T, B, 2), 0.7))
    for key in ("policy_logits", "baseline"):
        torch.testing.assert_close(model(quiet, action="none")[0][key], model(loud, action="none")[0][key])
    with_feedback = make_model(MLPConfig(hidden_sizes=[8], separate_critic=separate_critic), spec)
    assert with_feedback.baseline.in_features == 8 + 2 + 1  # features, last action, reward
    assert not torch.equal(
        with_feedback(quiet, action="none")[0]["baseline"], with_feedback(loud, action="none")[0]["baseline"]
    )


def test_a_box_policy_starts_from_the_configured_spread():
    spec = EnvSpec.box((4,), np.float32, action_spec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "Test-v0"))
    step = dict(frame=torch.randn(5, 3, 4), done=torch.zeros(5, 3, dtype=torch.bool), reward=torch.zeros(5, 3))
    step["last_action"] = torch.zeros(5, 3, 2)
    for init_log_std in (0.0, -0.7):
        model = make_model(MLPConfig(hidden_sizes=[8], init_log_std=init_log_std), spec)
        params = model(step, action="none")[0]["policy_logits"]
        torch.testing.assert_close(params[..., 2:], torch.full((5, 3, 2), init_log_std))  # [mean, log std]
        actions = torch.stack([model(step)[0]["action"] for _ in range(200)])
        assert abs(actions.std().item() - np.exp(init_log_std)) < 0.1  # the samples spread as set
    with pytest.raises(ConfigError, match="model.init_log_std must be within"):
        make_model(MLPConfig(hidden_sizes=[8], init_log_std=3.0), spec)
    with pytest.raises(ConfigError, match="this env's actions are not a Box"):
        make_model(MLPConfig(hidden_sizes=[8], init_log_std=-0.7), VECTOR)


def test_running_norm_learns_from_the_learner_only_and_is_checkpointed():
    torch.manual_seed(0)
    spec = EnvSpec.box((3,), np.float32, 2)
    model = make_model(MLPConfig(hidden_sizes=[8], normalize_obs=True), spec)
    norm = model.body.normalize
    assert norm.count == 0  # building and checking the model (no_grad) taught it nothing
    frames = torch.randn(50, 40, 3, dtype=torch.float64) * torch.tensor([1.0, 10.0, 100.0]) + 5
    inputs = dict(
        frame=frames,
        reward=torch.zeros(50, 40),
        done=torch.zeros(50, 40, dtype=torch.bool),
        last_action=torch.zeros(50, 40, dtype=torch.long),
    )
    model.train()
    for half in (slice(0, 25), slice(25, 50)):  # the learner's pass on two batches
        model({key: value[half] for key, value in inputs.items()}, action="none")
    flat = frames.reshape(-1, 3)
    torch.testing.assert_close(norm.mean, flat.mean(0))
    torch.testing.assert_close(norm.var, flat.var(0, unbiased=False))
    assert norm.count == 2000
    state = model.state_dict()
    assert {"body.normalize.mean", "body.normalize.var", "body.normalize.count"} <= set(state)
    acting = make_model(MLPConfig(hidden_sizes=[8], normalize_obs=True), spec)
    acting.load_state_dict(state)
    acting.eval()
    with torch.no_grad():
        acting(inputs)  # acting and test mode: frozen
    torch.testing.assert_close(acting.body.normalize.mean, norm.mean)
    normalised = norm(flat.float())
    assert normalised.abs().max() <= 10.0 and torch.allclose(normalised.mean(0), torch.zeros(3), atol=1e-3)


def test_running_norm_keeps_absurd_rows_out_of_its_statistics(caplog):
    """A broken env's or client's finite 1e30 (float32 takes it) must not swamp the moments for
    the rest of the run; a dimension that held still and starts to move still counts."""
    torch.manual_seed(0)
    clean = [torch.randn(64, 3, dtype=torch.float64) * torch.tensor([1.0, 50.0, 0.0]) + 3 for _ in range(3)]
    clean[2][:, 2] = torch.randn(64, dtype=torch.float64) * 20  # still until now, then moving
    norm, reference = RunningNorm(3).train(), RunningNorm(3).train()
    for i, batch in enumerate(clean):
        poisoned = batch.clone()
        if i < 2:
            poisoned[5 * i : 5 * i + 4, i] = 1e30 * (-1) ** i  # 4 of 64 rows: one client's envs
        norm(poisoned)
        reference(batch[[row for row in range(64) if not (i < 2 and 5 * i <= row < 5 * i + 4)]])
    assert norm.count == reference.count == 64 * 3 - 8 and norm.rows_left_out == 8
    torch.testing.assert_close(norm.mean, reference.mean)
    torch.testing.assert_close(norm.var, reference.var)
    assert norm.var[2] > 50  # the dimension that started to move
    assert caplog.text.count("left 4 of 64 observations out of the running statistics") == 1  # said once


def test_running_norm_with_ranks_merges_the_batches_of_every_rank():
    """With sum_over_ranks (an all_reduce: here, adding the other rank's sums), a rank's statistics
    are those of one norm that saw every rank's batches."""
    torch.manual_seed(0)
    scale = torch.tensor([1.0, 10.0, 1e3], dtype=torch.float64)
    rank, alone = RunningNorm(3).train(), RunningNorm(3).train()
    for _ in range(3):
        mine, theirs = (torch.randn(40, 3, dtype=torch.float64) * scale + 1e3 for _ in range(2))
        other_rank = copy.deepcopy(rank)  # the same statistics, its own batch: gives its sums
        given = []
        other_rank.sum_over_ranks = given.append
        other_rank(theirs)
        rank.sum_over_ranks = lambda sums, given=given: sums.add_(given[0])
        rank(mine)
        alone(torch.cat([mine, theirs]))
    assert rank.count == alone.count == 240
    torch.testing.assert_close(rank.mean, alone.mean)
    torch.testing.assert_close(rank.var, alone.var)


def test_mlp_activation_is_chosen_by_name_and_a_wrong_name_is_refused():
    spec = EnvSpec.box((4,), np.dtype("float32"), 2)
    tanh = make_model(MLPConfig(activation="tanh"), spec)
    assert [type(m).__name__ for m in tanh.body.layers if not isinstance(m, (torch.nn.Linear, torch.nn.Flatten))] == [
        "Tanh",
        "Tanh",
    ]
    with pytest.raises(ConfigError, match="model.activation='gelu' is not one of relu, tanh"):
        make_model(MLPConfig(activation="gelu"), spec)


SCHEMAS = ("AtariNetConfig", "ResNetConfig", "MLPConfig", "MultiConfig", "NetHackConfig")


@pytest.mark.parametrize("schema_name", SCHEMAS)
def test_each_bodys_constructor_defaults_are_its_settings_defaults(schema_name):
    """A default lives in agent/settings.py and again in the body's signature (for use without the
    config): the two must agree, and every field of the schema beyond ModelConfig's must be one of
    the body's parameters."""
    import dataclasses
    import inspect

    import hydra

    from torchbeast_hydra.agent import settings

    schema = getattr(settings, schema_name)
    body = hydra.utils.get_class(schema._target_)
    parameters = inspect.signature(body.__init__).parameters
    core = {f.name for f in dataclasses.fields(settings.ModelConfig)}
    own = [f for f in dataclasses.fields(schema) if f.name not in core]
    assert own, schema_name
    for f in own:
        assert f.name in parameters, f"{schema_name}.{f.name} is no parameter of {body.__name__}"
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        in_body = parameters[f.name].default
        assert in_body is not inspect.Parameter.empty, f"{body.__name__}({f.name}) has no default"
        as_list = list(in_body) if isinstance(in_body, (tuple, list)) else in_body
        assert as_list == default, f"{body.__name__}({f.name}={in_body!r}) but {schema_name}.{f.name}={default!r}"
