"""Action distributions: an action space (actions.ActionSpec) -> the policy's distribution.

A distribution is given by a flat vector of parameters per step, params [..., num_params], which
is what the model's policy head outputs and what the behaviour policy records in rollouts (the
rollout layout's `policy_logits`, layout.py). Each kind says how to sample, act greedily (test
mode), score the taken action (log_prob, summed over independent dimensions), and measure
entropy and KL (for extra loss terms). V-trace needs only log_prob: log rho = target - behaviour.

- Discrete: one categorical (params: n logits).
- MultiDiscrete: one categorical per dimension (params: the dimensions' logits, concatenated).
- MultiBinary: a Bernoulli per dimension (params: one logit each).
- Box: a diagonal Gaussian (params: mean, then log std). The log std is one learned parameter per
  dimension, independent of the state (as in PPO's MuJoCo setups: steadier than a state-dependent
  one early on), recorded per step because it changes between acting and learning. Samples are
  not squashed: the bounds are applied (clipped) only where the action enters the env
  (actions.to_env), and the log-probability of the unclipped sample is kept, so the policy
  gradient stays unbiased; a tanh squash would need a Jacobian correction, clipping needs none.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchbeast_hydra.env.actions import BOX, DISCRETE, MULTI_BINARY, MULTI_DISCRETE, ActionSpec

LOG_STD_BOUNDS = (-5.0, 2.0)  # std in [0.007, 7.4]: no collapse to a point, no runaway exploration


class NonFiniteAction(RuntimeError):
    """The policy produced a NaN/inf action: stepping an env with it would poison the run."""


class Distribution:
    """The interface of every kind; params [..., num_params], actions [..., *spec.step_shape]."""

    encoded_size: int  # the size of the last action's encoding (the core's input)

    def __init__(self, spec: ActionSpec):
        self.spec = spec
        self.num_params = spec.num_params  # the policy head's output size

    def head(self, in_size: int) -> nn.Module:
        """The policy head: core features [N, in_size] -> params [N, num_params] (the model
        initialises its linear layers)."""
        return nn.Linear(in_size, self.num_params)

    def encode(self, actions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sample(self, params: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def greedy(self, params: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def log_prob(self, params: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def entropy(self, params: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kl(self, params: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """KL(self at params || self at other), per step."""
        raise NotImplementedError


def _sample_categorical(logits: torch.Tensor) -> torch.Tensor:
    # Diverged weights (inf/NaN logits) must not crash the actors: they act uniformly there, and
    # the learner's optim.on_nonfinite decides what the run does about it.
    probs = torch.nan_to_num(F.softmax(logits, dim=-1), nan=1.0, posinf=1.0)
    return torch.multinomial(probs.reshape(-1, logits.shape[-1]), 1).view(logits.shape[:-1])


def _categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    log_policy = F.log_softmax(logits, dim=-1)
    return -(log_policy.exp() * log_policy).sum(-1)


def _categorical_kl(logits: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    log_p, log_q = F.log_softmax(logits, dim=-1), F.log_softmax(other, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class Categorical(Distribution):
    """Discrete: params are the logits; actions are indices [...]."""

    def __init__(self, spec: ActionSpec):
        super().__init__(spec)
        self.encoded_size = spec.nvec[0]

    def encode(self, actions):
        return F.one_hot(actions, self.encoded_size).float()

    def sample(self, params):
        return _sample_categorical(params)

    def greedy(self, params):
        return params.argmax(dim=-1)

    def log_prob(self, params, actions):
        return F.log_softmax(params, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    def entropy(self, params):
        return _categorical_entropy(params)

    def kl(self, params, other):
        return _categorical_kl(params, other)


class MultiCategorical(Distribution):
    """MultiDiscrete: one categorical per dimension, their logits concatenated; actions [..., D]."""

    def __init__(self, spec: ActionSpec):
        super().__init__(spec)
        self.sizes = list(spec.nvec)
        self.encoded_size = sum(self.sizes)

    def _split(self, params):
        return params.split(self.sizes, dim=-1)

    def encode(self, actions):
        return torch.cat([F.one_hot(actions[..., i], n) for i, n in enumerate(self.sizes)], dim=-1).float()

    def sample(self, params):
        return torch.stack([_sample_categorical(logits) for logits in self._split(params)], dim=-1)

    def greedy(self, params):
        return torch.stack([logits.argmax(dim=-1) for logits in self._split(params)], dim=-1)

    def log_prob(self, params, actions):
        return sum(
            F.log_softmax(logits, dim=-1).gather(-1, actions[..., i : i + 1]).squeeze(-1)
            for i, logits in enumerate(self._split(params))
        )

    def entropy(self, params):
        return sum(_categorical_entropy(logits) for logits in self._split(params))

    def kl(self, params, other):
        return sum(_categorical_kl(p, q) for p, q in zip(self._split(params), self._split(other)))


class Bernoulli(Distribution):
    """MultiBinary: an independent Bernoulli per dimension, params its logit; actions [..., D] in {0, 1}."""

    def __init__(self, spec: ActionSpec):
        super().__init__(spec)
        self.encoded_size = spec.size

    def encode(self, actions):
        return actions.float()

    def sample(self, params):
        probs = torch.nan_to_num(torch.sigmoid(params), nan=0.5)  # as Categorical: diverged weights act at random
        return torch.bernoulli(probs).long()

    def greedy(self, params):
        return (params > 0).long()

    def log_prob(self, params, actions):
        return -F.binary_cross_entropy_with_logits(params, actions.to(params.dtype), reduction="none").sum(-1)

    def entropy(self, params):
        # H = softplus(x) - x * sigmoid(x), stable for large |x|.
        return (F.softplus(params) - params * torch.sigmoid(params)).sum(-1)

    def kl(self, params, other):
        p = torch.sigmoid(params)
        log_p1, log_p0 = F.logsigmoid(params), F.logsigmoid(-params)
        log_q1, log_q0 = F.logsigmoid(other), F.logsigmoid(-other)
        return (p * (log_p1 - log_q1) + (1 - p) * (log_p0 - log_q0)).sum(-1)


class GaussianHead(nn.Module):
    """core features -> [mean, log std]: a linear mean and one learned log std per dimension."""

    def __init__(self, in_size: int, size: int):
        super().__init__()
        self.mean = nn.Linear(in_size, size)
        self.log_std = nn.Parameter(torch.zeros(size))  # std 1 at first

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        mean = self.mean(features)
        log_std = self.log_std.clamp(*LOG_STD_BOUNDS).expand_as(mean)
        return torch.cat([mean, log_std], dim=-1)


class DiagGaussian(Distribution):
    """Box: a diagonal Gaussian; params [mean (D), log std (D)]; actions [..., D], unclipped."""

    def __init__(self, spec: ActionSpec):
        super().__init__(spec)
        self.size = self.encoded_size = spec.size

    def head(self, in_size):
        return GaussianHead(in_size, self.size)

    def _split(self, params):
        return params[..., : self.size], params[..., self.size :]

    def encode(self, actions):
        return actions.float()

    def sample(self, params):
        mean, log_std = self._split(params)
        actions = mean + log_std.exp() * torch.randn_like(mean)
        if not torch.isfinite(actions).all():
            raise NonFiniteAction(
                f"the policy produced a non-finite Box action (mean {mean[~torch.isfinite(actions)][:4].tolist()}): "
                "look for NaN/inf observations, or lower optim.learning_rate."
            )
        return actions

    def greedy(self, params):
        return self._split(params)[0]

    def log_prob(self, params, actions):
        mean, log_std = self._split(params)
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def entropy(self, params):
        return (self._split(params)[1] + 0.5 * math.log(2 * math.pi * math.e)).sum(-1)

    def kl(self, params, other):
        mean_p, log_std_p = self._split(params)
        mean_q, log_std_q = self._split(other)
        var_ratio = torch.exp(2 * (log_std_p - log_std_q))
        z = (mean_p - mean_q) * torch.exp(-log_std_q)
        return (0.5 * (var_ratio + z.pow(2) - 1) - (log_std_p - log_std_q)).sum(-1)


KINDS = {DISCRETE: Categorical, MULTI_DISCRETE: MultiCategorical, MULTI_BINARY: Bernoulli, BOX: DiagGaussian}


def distribution(spec: ActionSpec) -> Distribution:
    return KINDS[spec.kind](spec)
