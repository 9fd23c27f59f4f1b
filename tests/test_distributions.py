"""Action distributions against torch.distributions, the Discrete path's losses and gradients against
the code it replaced, and the action spaces' specs, checks and conversion for the env."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import distributions as td

from torchbeast_hydra.agent.distributions import NonFiniteAction, distribution
from torchbeast_hydra.agent.models import ActorCritic, MLPBody
from torchbeast_hydra.env.actions import ActionError, ActionSpec, action_spec, check, random_actions, to_env
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning import vtrace
from torchbeast_hydra.learning.learner import compute_losses
from torchbeast_hydra.learning.settings import RewardClipping, VtraceConfig

SPACES = {
    "discrete": gym.spaces.Discrete(5),
    "multi_discrete": gym.spaces.MultiDiscrete([3, 4, 2]),
    "multi_binary": gym.spaces.MultiBinary(4),
    "box": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
}


def spec_of(kind: str) -> ActionSpec:
    return action_spec(SPACES[kind], "Test-v0")


def reference(kind: str, params: torch.Tensor) -> td.Distribution:
    """torch.distributions' version of what distributions.py computes by hand."""
    spec = spec_of(kind)
    if kind == "discrete":
        return td.Categorical(logits=params)
    if kind == "multi_binary":
        return td.Independent(td.Bernoulli(logits=params), 1)
    if kind == "box":
        mean, log_std = params.chunk(2, dim=-1)
        return td.Independent(td.Normal(mean, log_std.exp()), 1)
    return [td.Categorical(logits=p) for p in params.split(list(spec.nvec), dim=-1)]


def random_params(kind: str, seed: int, shape=(4, 3)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, spec_of(kind).num_params, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("kind", SPACES)
def test_log_prob_entropy_and_kl_match_torch_distributions(kind):
    dist = distribution(spec_of(kind))
    params, other = random_params(kind, 0), random_params(kind, 1)
    if kind == "box":  # log stds in the head's range
        params[..., 3:], other[..., 3:] = params[..., 3:].clamp(-2, 1), other[..., 3:].clamp(-2, 1)
    actions = dist.sample(params)
    assert actions.shape == (4, 3, *spec_of(kind).step_shape)
    ref, ref_other = reference(kind, params), reference(kind, other)
    if kind == "multi_discrete":
        expected_log_prob = sum(r.log_prob(actions[..., i]) for i, r in enumerate(ref))
        expected_entropy = sum(r.entropy() for r in ref)
        expected_kl = sum(td.kl_divergence(p, q) for p, q in zip(ref, ref_other))
    else:
        expected_log_prob = ref.log_prob(actions.to(params.dtype) if kind == "multi_binary" else actions)
        expected_entropy = ref.entropy()
        expected_kl = td.kl_divergence(ref, ref_other)
    torch.testing.assert_close(dist.log_prob(params, actions), expected_log_prob)
    torch.testing.assert_close(dist.entropy(params), expected_entropy)
    torch.testing.assert_close(dist.kl(params, other), expected_kl)
    torch.testing.assert_close(dist.kl(params, params), torch.zeros(4, 3, dtype=params.dtype))


@pytest.mark.parametrize("kind", SPACES)
def test_samples_follow_the_distribution_and_greedy_takes_its_mode(kind):
    torch.manual_seed(0)
    spec = spec_of(kind)
    dist = distribution(spec)
    params = random_params(kind, 2, shape=(1,)).float().expand(20_000, -1)
    samples = dist.sample(params)
    greedy = dist.greedy(params[:1])[0]
    if kind == "box":
        mean, log_std = params[0].chunk(2)
        torch.testing.assert_close(samples.mean(0), mean, atol=0.05, rtol=0)
        torch.testing.assert_close(samples.std(0), log_std.exp(), atol=0.05, rtol=0.05)
        torch.testing.assert_close(greedy, mean)
        return
    # The most frequent value of each dimension is the mode, and frequencies follow the probabilities.
    samples = samples.view(len(samples), -1)
    if kind == "multi_binary":  # P(1) = sigmoid(logit)
        per_dim = [torch.stack([1 - torch.sigmoid(x), torch.sigmoid(x)]) for x in params[0]]
    else:
        per_dim = [F.softmax(logits, dim=-1) for logits in params[0].split(list(spec.nvec))]
    for i, probs in enumerate(per_dim):
        counts = torch.bincount(samples[:, i], minlength=len(probs)).float() / len(samples)
        torch.testing.assert_close(counts, probs, atol=0.02, rtol=0)
        assert greedy.view(-1)[i] == probs.argmax()


def test_a_non_finite_box_action_is_an_error_naming_it():
    dist = distribution(spec_of("box"))
    params = torch.zeros(2, 6)
    params[1, 0] = float("nan")
    with pytest.raises(NonFiniteAction, match="non-finite Box action"):
        dist.sample(params)


def test_categorical_kinds_act_uniformly_on_diverged_logits():
    params = torch.full((8, spec_of("multi_discrete").num_params), float("nan"))
    actions = distribution(spec_of("multi_discrete")).sample(params)
    assert ((actions >= 0) & (actions < torch.tensor([3, 4, 2]))).all()


# -- the learner's Discrete path, against the code it replaced ------------------------------------


def old_losses(cfg: VtraceConfig, batch: dict, outputs: dict) -> dict:
    """learner.compute_losses before action distributions: vtrace.from_logits' log-probabilities,
    a cross-entropy policy gradient and a softmax entropy (copied, not imported)."""
    bootstrap_value = outputs["baseline"][-1]
    steps = {key: value[1:] for key, value in batch.items()}
    outputs = {key: value[:-1] for key, value in outputs.items()}
    mask = steps["mask"].float()
    rewards = steps["reward"]
    discounts = (~steps["done"]).float() * cfg.discounting
    returns = vtrace.from_logits(
        steps["policy_logits"],
        outputs["policy_logits"],
        steps["action"],
        discounts,
        rewards,
        outputs["baseline"],
        bootstrap_value,
        cfg.clip_rho_threshold,
        cfg.clip_pg_rho_threshold,
    )
    logits = outputs["policy_logits"]
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), steps["action"].flatten(), reduction="none")
    pg = (cross_entropy.view_as(mask) * returns.pg_advantages.detach() * mask).sum()
    baseline = cfg.baseline_cost * 0.5 * (((returns.vs - outputs["baseline"]) ** 2) * mask).sum()
    log_policy = F.log_softmax(logits, dim=-1)
    entropy = cfg.entropy_cost * ((log_policy.exp() * log_policy).sum(-1) * mask).sum()
    return dict(total_loss=pg + baseline + entropy, pg_loss=pg, baseline_loss=baseline, entropy_loss=entropy)


def discrete_batch(T=6, B=4, A=5, seed=0) -> tuple[dict, ActorCritic]:
    torch.manual_seed(seed)
    model = ActorCritic(MLPBody((3,), hidden_sizes=(16,)), A, use_lstm=False)
    batch = dict(
        frame=torch.randn(T + 1, B, 3),
        reward=torch.randn(T + 1, B),
        done=torch.rand(T + 1, B) < 0.2,
        last_action=torch.randint(0, A, (T + 1, B)),
        action=torch.randint(0, A, (T + 1, B)),
        policy_logits=torch.randn(T + 1, B, A),
        mask=torch.ones(T + 1, B, dtype=torch.bool),
    )
    return batch, model


def test_discrete_losses_and_gradients_are_those_of_the_code_it_replaced():
    cfg = VtraceConfig(reward_clipping=RewardClipping.none, entropy_cost=0.01)
    batch, model = discrete_batch()
    results = []
    for compute in (old_losses, lambda c, b, o: compute_losses(c, b, o, dist=model.dist)):
        model.zero_grad()
        outputs, _ = model(batch, (), action="none")
        losses = compute(cfg, batch, outputs)
        losses["total_loss"].backward()
        results.append((losses, [p.grad.clone() for p in model.parameters()]))
    (old, old_grads), (new, new_grads) = results
    for name in old:
        torch.testing.assert_close(new[name], old[name])
    for new_grad, old_grad in zip(new_grads, old_grads):
        torch.testing.assert_close(new_grad, old_grad)


# -- the spaces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Text(5), gym.spaces.Box(-np.inf, np.inf, (2,)), gym.spaces.Box(0, 5, (2,), np.int64)],
    ids=["text", "unbounded", "integer_box"],
)
def test_other_spaces_are_refused_with_one_line_naming_them(space):
    with pytest.raises(ConfigError, match=r"has action space .*not supported.*Discrete, MultiDiscrete") as error:
        action_spec(space, "Test-v0")
    assert "\n" not in str(error.value) and str(space)[:8] in str(error.value)


def test_spec_sizes_follow_the_space():
    assert [spec_of(kind).num_params for kind in SPACES] == [5, 9, 4, 6]
    assert [spec_of(kind).step_shape for kind in SPACES] == [(), (3,), (4,), (3,)]
    for kind in SPACES:
        spec = spec_of(kind)
        dist = distribution(spec)
        assert dist.head(7)(torch.zeros(2, 7)).shape == (2, spec.num_params)  # the head gives what the layout holds


def test_actions_reach_the_env_in_its_own_form():
    multi = action_spec(gym.spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[1, 1], [0, -2]]), "Test-v0")
    sent = to_env(multi)(np.array([1, 2, 3, 4]))
    assert sent.tolist() == [[2, 3], [3, 2]] and gym.spaces.MultiDiscrete(
        [[2, 3], [4, 5]], start=[[1, 1], [0, -2]]
    ).contains(sent)
    assert to_env(action_spec(gym.spaces.Discrete(3, start=-1), "Test-v0"))(np.int64(0)) == -1
    box = to_env(spec_of("box"))(np.array([3.0, -0.5, -7.0], np.float32))
    assert box.tolist() == [1.0, -0.5, -1.0] and SPACES["box"].contains(box)
    assert SPACES["multi_binary"].contains(to_env(spec_of("multi_binary"))(np.array([1, 0, 0, 1])))


@pytest.mark.parametrize("kind", SPACES)
def test_random_actions_cover_the_space_uniformly(kind):
    spec = spec_of(kind)
    actions = random_actions(spec, np.random.default_rng(0), 4000)
    assert actions.shape == (4000, *spec.step_shape)
    check(spec, actions, taken=True)  # values of the space, as the model gives them
    assert all(SPACES[kind].contains(to_env(spec)(a)) for a in actions[:100])
    flat = actions.reshape(4000, -1)
    if kind == "box":  # uniform on [-1, 1]: mean 0, a quarter below -0.5
        assert np.abs(flat.mean(0)).max() < 0.05 and np.allclose((flat < -0.5).mean(0), 0.25, atol=0.03)
    else:  # every choice of every dimension, each about equally often
        for dim, n in enumerate(spec.nvec):
            assert np.allclose(np.bincount(flat[:, dim], minlength=n) / 4000, 1 / n, atol=0.03)


def test_check_refuses_out_of_range_and_non_finite_actions():
    check(spec_of("multi_discrete"), np.array([[2, 3, 1], [0, 0, 0]]))
    with pytest.raises(ActionError, match=r"outside the action space MultiDiscrete\(\[3, 4, 2\]\) for envs \[1\]$"):
        check(spec_of("multi_discrete"), np.array([[2, 3, 1], [2, 4, 1]]))  # the rows, not every value
    with pytest.raises(ActionError, match="outside"):
        check(spec_of("multi_binary"), np.array([[0, 2, 0, 0]]))
    with pytest.raises(ActionError, match=r"not finite .* envs \[1\]"):
        check(spec_of("box"), np.array([[0, 0, 0], [0, math.inf, 0]], np.float32))
    check(spec_of("box"), np.array([[5.0, -5.0, 0.0]], np.float32))  # unclipped samples are fine
