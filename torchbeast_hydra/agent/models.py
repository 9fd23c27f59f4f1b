"""Policies: a body that turns observations into features, then a shared actor-critic core.

Every model takes time-major inputs [T, B, ...] (the observation's keys: `frame`, or a Dict/Tuple
observation's leaves `obs/...`; reward, done, last_action) and returns policy_logits [T, B, P] (the
action distribution's parameters, distributions.py: logits for a Discrete space), baseline [T, B]
and (unless asked not to) action [T, B, ...]. The core appends the encoded last action (one-hot per
categorical dimension, the raw vector for Box) and the clipped reward to the features and, with
use_lstm, runs an LSTM whose state is zeroed at episode boundaries (done). To try a new
architecture, write a
`Body` and a YAML file naming it (`_target_`): see docs/extending.md.
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import Callable

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from torchbeast_hydra.agent.distributions import LOG_STD_BOUNDS, GaussianHead, distribution
from torchbeast_hydra.agent.settings import AtariNetConfig, MLPConfig, ModelConfig, ResNetConfig
from torchbeast_hydra.env.actions import ActionSpec
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.errors import ConfigError, require

log = logging.getLogger(__name__)


class Body(nn.Module):
    """The contract of a model body: observations in, features out.

    - `__init__(obs_shape, **fields)`: obs_shape describes the env's observation (envs.EnvSpec
      .obs_shape); the other keyword arguments are the fields of the model's YAML file (model.*).
    - `output_size`: the size of the features, set in __init__.
    - `forward(obs)` -> features [N, output_size], float. obs has the observation's form:
      - an observation that is one array (Box, e.g. Atari frames, CartPole's vector): obs_shape is
        its shape (a tuple) and obs the tensor [N, *obs_shape] (`frame`);
      - a Dict/Tuple observation: obs_shape is a dict, leaf key (obs/glyphs, obs/inner/0) -> that
        leaf's gymnasium space (its .shape, .dtype, bounds or n), and obs the dict of tensors
        [N, *space.shape], one per leaf (env.obs_keys selects which).
      Tensors come in the env's dtype (uint8 for Atari, so scale them yourself).

    The core (ActorCritic) adds the policy and baseline heads and the optional LSTM; a body
    never sees time, rewards, actions or recurrent state.
    """

    output_size: int
    # Whether convolutions dominate this body's cost, so that a CPU learner with native bf16 math
    # computes it faster under bf16 autocast (accel.bf16_autocast=null, auto, turns it on there).
    bf16_on_cpu: bool = False


def _array_shape(obs_shape, model: str) -> tuple:
    """The shape of an observation that is one array; Dict/Tuple observations need another body."""
    if isinstance(obs_shape, dict):
        raise ValueError(
            f"{model} takes observations that are one array, but this env's has leaves {list(obs_shape)}: "
            "use model=multi (one encoder per leaf), model=nethack (NetHack, MiniHack) or a body of yours."
        )
    return tuple(obs_shape)


def _image_shape(obs_shape: tuple, model: str) -> tuple:
    if len(_array_shape(obs_shape, model)) != 3:
        raise ValueError(
            f"{model} needs image observations [channels, height, width], but the env's observations "
            f"have shape {tuple(obs_shape)}. Use model=mlp for vector observations."
        )
    return tuple(obs_shape)


def _flat_size(layers: nn.Module, obs_shape: tuple, model: str) -> int:
    try:
        with torch.no_grad():
            return layers(torch.zeros(1, *obs_shape)).shape[1]
    except RuntimeError as error:
        raise ValueError(
            f"{model} does not fit observations of shape {tuple(obs_shape)} ({error}); "
            "use images of at least 36x36 (env.screen_size) or another model."
        ) from None


# False while make_model builds a copy whose weights are about to be overwritten (initialise=False).
_initialising = contextvars.ContextVar("initialising", default=True)


def orthogonal_(module: nn.Module, gain: float) -> None:
    """Orthogonal weights and zero biases for every conv and linear layer in module (not in a copy
    that make_model builds with initialise=False: a QR per layer, ~1 s for AtariNet on one core).

    With gain sqrt(2) (ReLU's) the signal keeps its scale through the layers; torch's default
    init shrinks it at each, so that Pong's frames, which differ only in the ball and paddles,
    give features that hardly differ (36x less than here, measured): A2C's and PPO's Atari
    convention."""
    if not _initialising.get():
        return
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)


class AtariNetBody(Body):
    """TorchBeast's shallow network: three conv layers (as in the DQN Nature paper) + fc 512."""

    bf16_on_cpu = True

    def __init__(self, obs_shape: tuple, output_size: int = 512):
        super().__init__()
        channels, height, width = _image_shape(obs_shape, "model=atari_net")
        self.convs = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, kernel_size=3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.fc = nn.Linear(_flat_size(self.convs, obs_shape, "model=atari_net"), output_size)
        self.output_size = output_size
        orthogonal_(self, gain=math.sqrt(2))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.float() / 255.0
        return F.relu(self.fc(self.convs(x)))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ResNetBody(Body):
    """The IMPALA paper's deep network: stacks of conv + max-pool + two residual blocks."""

    bf16_on_cpu = True

    def __init__(self, obs_shape: tuple, channels=(16, 32, 32), output_size: int = 256):
        super().__init__()
        layers = []
        in_channels = _image_shape(obs_shape, "model=resnet")[0]
        for out_channels in channels:
            layers += [
                nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
                ResidualBlock(out_channels),
                ResidualBlock(out_channels),
            ]
            in_channels = out_channels
        self.stacks = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(_flat_size(self.stacks, obs_shape, "model=resnet"), output_size)
        self.output_size = output_size

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.float() / 255.0
        return F.relu(self.fc(self.stacks(x)))


class RunningNorm(nn.Module):
    """Observations standardised by a running mean and variance, then clipped to +-clip.

    The statistics are buffers: they are checkpointed and copied to the acting policy with the
    weights. Only the learner's forward pass updates them (training mode, gradients on: the acting
    copies run in eval mode under no_grad, test mode in eval mode), so they follow the data the
    learner sees and stay frozen in test mode. `frozen` holds them while the learner reuses a
    batch (learner.frozen), so each sample counts once. With data-parallel ranks the learner sets
    `sum_over_ranks`, and every rank merges the moments of all the ranks' batches: their
    statistics, like their weights, stay the same.

    A row with a value absurdly far from the rest of its batch (`outlier_spreads` median absolute
    deviations from the batch's median, the deviation taken as at least 1) stays out of the
    statistics: the finite 1e30 of a broken env or client would otherwise swamp the cumulative
    moments for the rest of the run. The batch's own median, not the running mean, is the
    reference: robust while such rows are a minority, and not fooled by a dimension that held
    still until now. The model still sees the row, standardised and clipped like any other.
    """

    frozen = False
    sum_over_ranks: Callable[[torch.Tensor], None] | None = None  # in place, as torch.distributed.all_reduce
    outlier_spreads = 1e4

    def __init__(self, size: int, clip: float = 10.0, epsilon: float = 1e-8):
        super().__init__()
        self.clip, self.epsilon = clip, epsilon
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("var", torch.ones(size, dtype=torch.float64))
        self.rows_left_out = 0  # rows kept out of the statistics as outliers, since this process started

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and not self.frozen:
            self._update(x.detach().double())
        std = torch.sqrt(self.var + self.epsilon).to(x.dtype)
        return ((x - self.mean.to(x.dtype)) / std).clamp(-self.clip, self.clip)

    def observe(self, x: torch.Tensor) -> None:
        """Merges rows [N, size] into the statistics (unless frozen), outside a forward pass."""
        if not self.frozen and len(x):
            self._update(x.detach().double())

    @torch.no_grad()
    def _update(self, x: torch.Tensor) -> None:
        """Merges the batch's moments into the running ones (Chan et al.'s parallel algorithm)."""
        x = self._without_outliers(x)
        # Sums, so that ranks can add theirs; about the running mean, so that they stay well conditioned.
        centred = x - self.mean
        sums = torch.cat([centred.new_tensor([x.shape[0]]), centred.sum(0), centred.pow(2).sum(0)])
        if self.sum_over_ranks is not None:
            self.sum_over_ranks(sums)
        n, (first, second) = sums[0], sums[1:].split(x.shape[1])
        offset = first / n  # the batch's mean less the running one
        var = (second / n - offset.pow(2)).clamp(min=0)  # the batch's
        total = self.count + n
        self.var.copy_((self.var * self.count + var * n + offset.pow(2) * self.count * n / total) / total)
        self.mean.add_(offset * n / total)
        self.count.copy_(total)

    def _without_outliers(self, x: torch.Tensor) -> torch.Tensor:
        deviation = (x - x.median(0).values).abs()
        spread = deviation.median(0).values.clamp(min=1.0)
        fit = (deviation <= self.outlier_spreads * spread).all(1)
        left_out = len(x) - int(fit.sum())  # the one read back from the device
        if not left_out:
            return x
        if not self.rows_left_out:
            log.warning(
                "model.normalize_obs: left %d of %d observations out of the running statistics, each with a "
                "value beyond %.0e median absolute deviations of its batch (an env or client sending garbage?); "
                "the model still sees them, clipped. (Said once; RunningNorm.rows_left_out counts them.)",
                left_out,
                len(x),
                self.outlier_spreads,
            )
        self.rows_left_out += left_out
        return x[fit]


class ValueNorm(nn.Module):
    """PopArt (van Hasselt et al., 2016; Hessel et al., 2019): the critic's head learns values
    standardised by running statistics of the value targets, and the core turns them back into
    returns (denormalize), so V-trace and every reader of `baseline` see returns as before.

    The learner updates the statistics after each optimiser step of a batch's first pass
    (update), from the targets of the steps it learned from, and rescales the head so that its
    outputs in returns are unchanged (Preserving Outputs Precisely). The value loss divides by
    the scale: whatever the task's reward scale, the critic fits targets of about unit size.
    The statistics are exponential moving averages (rate `beta` per update, bias-corrected as
    Adam's) of the targets' first and second moments; buffers, so checkpointed with the weights.
    """

    frozen = False  # as RunningNorm's: set while the learner reuses a batch

    def __init__(self, beta: float, epsilon: float = 1e-4):
        super().__init__()
        self.beta, self.epsilon = beta, epsilon
        self.register_buffer("first", torch.zeros((), dtype=torch.float64))  # EMAs, before bias correction
        self.register_buffer("second", torch.zeros((), dtype=torch.float64))
        self.register_buffer("updates", torch.zeros((), dtype=torch.float64))
        # What the EMAs give, kept up to date by update(): every forward pass (the actors' too) reads them.
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("std", torch.ones((), dtype=torch.float64))

    def denormalize(self, values: torch.Tensor) -> torch.Tensor:
        return values * self.std.to(values.dtype) + self.mean.to(values.dtype)

    @torch.no_grad()
    def update(self, mean: torch.Tensor, second: torch.Tensor, head: nn.Linear) -> None:
        """Moves the statistics towards a batch's (the targets' mean and mean square) and rescales
        `head`, the linear layer whose output is denormalised, to preserve its outputs."""
        old_mean, old_std = self.mean.clone(), self.std.clone()
        self.first.mul_(1 - self.beta).add_(self.beta * mean.double())
        self.second.mul_(1 - self.beta).add_(self.beta * second.double())
        self.updates.add_(1)
        correction = 1 - (1 - self.beta) ** self.updates
        self.mean.copy_(self.first / correction)
        self.std.copy_((self.second / correction - self.mean**2).clamp(min=self.epsilon**2).sqrt())
        head.weight.mul_((old_std / self.std).to(head.weight.dtype))
        head.bias.copy_(((old_std * head.bias.double() + old_mean - self.mean) / self.std).to(head.bias.dtype))


class MLPBody(Body):
    """Fully connected layers over a flattened vector observation (standardised first with
    normalize_obs: continuous control's observations differ in scale by orders of magnitude)."""

    ACTIVATIONS = dict(relu=nn.ReLU, tanh=nn.Tanh)

    def __init__(self, obs_shape: tuple, hidden_sizes=(64, 64), normalize_obs: bool = False, activation: str = "relu"):
        super().__init__()
        if not hidden_sizes:
            raise ValueError("model.hidden_sizes needs at least one layer.")
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"model.activation={activation!r} is not one of {', '.join(self.ACTIVATIONS)}.")
        layers, size = [], math.prod(_array_shape(obs_shape, "model=mlp"))
        self.normalize = RunningNorm(size) if normalize_obs else None
        for hidden in hidden_sizes:
            layers += [nn.Linear(size, hidden), self.ACTIVATIONS[activation]()]
            size = hidden
        self.layers = nn.Sequential(nn.Flatten(), *layers)
        self.output_size = size

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.float()
        if self.normalize is not None:
            x = self.normalize(x.flatten(1))
        return self.layers(x)


class ActorCritic(nn.Module):
    """Body -> [features, encoded last action, clipped reward] -> optional LSTM -> heads.

    feedback=False leaves out the last action and reward: the heads see the observation's features
    alone, as PPO's MLP policy does (IMPALA feeds them back for its LSTM agents)."""

    def __init__(
        self,
        body: nn.Module,
        actions: ActionSpec | int,
        use_lstm: bool,
        lstm_layers: int = 1,
        leaf_keys: tuple = ("frame",),
        critic_body: nn.Module | None = None,
        value_norm: ValueNorm | None = None,
        feedback: bool = True,
        init_log_std: float = 0.0,
    ):
        """actions: the env's action space (an int: that many Discrete actions); critic_body: a
        body of the baseline's own (model.separate_critic, feed-forward: the LSTM is the policy's),
        else the baseline shares `body` and the core; value_norm: the baseline head learns
        standardised values (model.normalize_values, PopArt); init_log_std: a Box policy's log std
        at the start (model.init_log_std)."""
        super().__init__()
        self.body = body
        self.critic_body = critic_body
        self.leaf_keys = tuple(leaf_keys)  # ("frame",): the body takes the tensor, else a dict of leaves
        self.actions = ActionSpec.discrete(actions) if isinstance(actions, int) else actions
        self.dist = distribution(self.actions)
        self.feedback = feedback
        feedback_size = self.dist.encoded_size + 1 if feedback else 0
        core_size = body.output_size + feedback_size
        self.use_lstm = use_lstm
        # One nn.LSTM call per stretch of steps without an episode start, rather than one per step
        # (the same math; accel.lstm_segments, set by the learner).
        self.lstm_segments = False
        if use_lstm:
            self.lstm = nn.LSTM(core_size, core_size, num_layers=lstm_layers)
        self.policy = self.dist.head(core_size)
        critic_size = core_size if critic_body is None else critic_body.output_size + feedback_size
        self.baseline = nn.Linear(critic_size, 1)
        self.value_norm = value_norm
        orthogonal_(self.policy, gain=0.01)  # a near-uniform (Box: centred) first policy, whatever the features
        orthogonal_(self.baseline, gain=1.0)
        if init_log_std != 0.0:
            _start_spread(self.policy, init_log_std)

    def initial_state(self, batch_size: int = 1, device: torch.device | str | None = None) -> tuple:
        """Zero core state [layers, batch_size, hidden] on `device` (default: the model's)."""
        if not self.use_lstm:
            return ()
        shape = (self.lstm.num_layers, batch_size, self.lstm.hidden_size)
        device = self.policy.weight.device if device is None else device
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def forward(self, inputs: dict, core_state: tuple = (), action: str = "sample"):
        """action: "sample" from the policy, "greedy" (argmax), or "none" (the learner's pass)."""
        T, B = inputs["done"].shape[:2]
        core_input = self._core_input(self.body, inputs)
        if self.use_lstm:
            core_output, core_state = self._lstm(core_input.view(T, B, -1), inputs["done"], core_state)
            core_output = core_output.flatten(0, 1)
            core_state = tuple(s.float() for s in core_state)  # carried between passes: fp32, as stored
        else:
            core_output = core_input
        # The outputs in fp32, under bf16 autocast too: actions are sampled from them, and V-trace
        # and the losses read them.
        params = self.policy(core_output).float()
        critic_input = core_output if self.critic_body is None else self._core_input(self.critic_body, inputs)
        baseline = self.baseline(critic_input).float()
        if self.value_norm is not None:
            baseline = self.value_norm.denormalize(baseline)
        outputs = dict(policy_logits=params.view(T, B, -1), baseline=baseline.view(T, B))
        if action == "greedy":
            outputs["action"] = self.dist.greedy(params).view(T, B, *self.actions.step_shape)
        elif action == "sample":
            outputs["action"] = self.dist.sample(params).view(T, B, *self.actions.step_shape)
        return outputs, core_state

    def _core_input(self, body: nn.Module, inputs: dict) -> torch.Tensor:
        """[T*B, features + reward + last action]: a body's features with the last step's feedback."""
        if self.leaf_keys == ("frame",):
            features = body(inputs["frame"].flatten(0, 1))
        else:
            features = body({key: inputs[key].flatten(0, 1) for key in self.leaf_keys})
        if not self.feedback:
            return features
        last_action = self.dist.encode(inputs["last_action"].flatten(0, 1))
        reward = inputs["reward"].flatten(0, 1).clamp(-1, 1).unsqueeze(-1)
        return torch.cat([features, reward, last_action], dim=-1)

    def _lstm(self, core_input: torch.Tensor, done: torch.Tensor, core_state: tuple):
        # cuDNN refuses a non-contiguous hidden state ("rnn: hx is not contiguous"), which batching
        # states across clients or envs can produce; the CPU kernel accepts it, so insist here.
        core_state = tuple(s.contiguous() for s in core_state)
        keep = (~done.bool()).float()  # zero the state where an episode starts
        if self.lstm_segments and core_input.shape[0] > 1:
            return self._lstm_by_segments(core_input, done, keep, core_state)
        outputs = []
        for step_input, step_keep in zip(core_input.unbind(), keep.unbind()):
            core_state = tuple(step_keep.view(1, -1, 1) * s for s in core_state)
            output, core_state = self.lstm(step_input.unsqueeze(0), core_state)
            outputs.append(output)
        return torch.cat(outputs), core_state

    def _lstm_by_segments(self, core_input, done, keep, core_state):
        """The step loop's result with one nn.LSTM call per segment between the steps where some
        env's episode starts (there the state is zeroed, as in the loop): one call for the whole
        unroll when no episode ends inside it."""
        starts = done.bool().any(dim=1)
        starts[0] = True  # the first step applies the mask to the state carried in
        # One host read per forward (the learner's): where the segments begin.
        bounds = [*starts.nonzero().flatten().tolist(), core_input.shape[0]]
        outputs = []
        for begin, end in zip(bounds[:-1], bounds[1:]):
            mask = keep[begin].view(1, -1, 1)
            core_state = tuple(mask * s for s in core_state)
            output, core_state = self.lstm(core_input[begin:end], core_state)
            outputs.append(output)
        return torch.cat(outputs), core_state


def _start_spread(policy: nn.Module, log_std: float) -> None:
    """A Gaussian policy head's log std at the start (model.init_log_std)."""
    if not isinstance(policy, GaussianHead):
        raise ConfigError(f"model.init_log_std={log_std} sets a Gaussian's spread: this env's actions are not a Box.")
    low, high = LOG_STD_BOUNDS
    require(low <= log_std <= high, f"model.init_log_std must be within [{low}, {high}] (got {log_std}).")
    nn.init.constant_(policy.log_std, log_std)


# The core's fields of a model config; the others are the body's (models.Body).
CORE_FIELDS = (
    "_target_",
    "use_lstm",
    "lstm_layers",
    "separate_critic",
    "normalize_values",
    "value_norm_beta",
    "feedback",
    "init_log_std",
)


def make_model(cfg, spec: EnvSpec, initialise: bool = True) -> ActorCritic:
    """The body named by cfg._target_, built for the env's spaces, on the actor-critic core.

    initialise=False: for a copy whose weights are about to be overwritten (an acting copy, an
    evaluator, the start-up check): our layers skip their orthogonal init; a body's own init stays.

    A body that cannot be built for this env, takes other fields than the config gives, or
    breaks the Body contract raises ConfigError (chained to the cause, whose traceback helps).
    """
    token = _initialising.set(initialise)
    try:
        return _make_model(cfg, spec)
    finally:
        _initialising.reset(token)


def _make_model(cfg, spec: EnvSpec) -> ActorCritic:
    fields = OmegaConf.to_container(OmegaConf.create(cfg) if not OmegaConf.is_config(cfg) else cfg, resolve=True)
    target = current_target(fields.get("_target_"))
    if not target:
        raise ConfigError("model._target_ must name the model's body class, e.g. my_pkg.models.MyBody.")
    body_fields = {key: value for key, value in fields.items() if key not in CORE_FIELDS}
    body = _make_body(target, body_fields, spec)
    critic_body = _make_body(target, body_fields, spec) if fields.get("separate_critic", False) else None
    lstm = fields.get("use_lstm", False), fields.get("lstm_layers", 1)
    beta = fields.get("value_norm_beta", ModelConfig.value_norm_beta)
    value_norm = ValueNorm(beta) if fields.get("normalize_values", False) else None
    return ActorCritic(
        body,
        spec.actions,
        *lstm,
        leaf_keys=spec.leaf_keys,
        critic_body=critic_body,
        value_norm=value_norm,
        feedback=fields.get("feedback", ModelConfig.feedback),
        init_log_std=fields.get("init_log_std", ModelConfig.init_log_std),
    )


def _make_body(target: str, body_fields: dict, spec: EnvSpec) -> nn.Module:
    try:
        body = hydra.utils.instantiate({"_target_": target, **body_fields}, obs_shape=spec.obs_shape, _convert_="all")
    except Exception as error:
        cause = error.__cause__ or error  # instantiate wraps the body's own error
        raise ConfigError(
            f"model {target} cannot be built for observations {spec.obs_shape} with {body_fields}: {cause}"
        ) from cause
    _check_body(body, target, spec)
    return body


def _check_body(body, target: str, spec: EnvSpec) -> None:
    """The Body contract, checked once on a dummy observation, before any process starts."""
    size = getattr(body, "output_size", None)
    if not isinstance(body, nn.Module) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"model {target} must be a torch.nn.Module with an int output_size (models.Body).")
    obs = {leaf.key: torch.from_numpy(np.stack([leaf.space.sample() for _ in range(2)])) for leaf in spec.leaves}
    with torch.no_grad():
        features = body(obs["frame"] if spec.single else obs)
    if tuple(features.shape) != (2, size) or not features.is_floating_point():
        raise ConfigError(
            f"model {target} returned features {tuple(features.shape)} {features.dtype} for "
            f"2 observations; the Body contract wants float [2, output_size={size}]."
        )


# Where the bodies were before the packages moved (0.1's torchbeast_hydra.models.MLPBody, ...):
# checkpoints and run dirs of those releases name them so, and still build.
MOVED = {
    "torchbeast_hydra.models.": "torchbeast_hydra.agent.models.",
    "torchbeast_hydra.encoders.": "torchbeast_hydra.agent.encoders.",
}


def current_target(target: str | None) -> str | None:
    """A body's _target_ at today's path (an old path through MOVED; any other as given)."""
    for old, new in MOVED.items():
        if target and target.startswith(old):
            return new + target.removeprefix(old)
    return target


# Checkpoints written before models were named by _target_ named them by model.name.
_NAMED_BEFORE = dict(atari_net=AtariNetConfig, resnet=ResNetConfig, mlp=MLPConfig)


def saved_model_config(saved: dict) -> dict:
    """The model config a checkpoint was trained with, in today's form (older ones had model.name)."""
    if "_target_" in saved or saved.get("name") not in _NAMED_BEFORE:
        return saved
    schema = OmegaConf.structured(_NAMED_BEFORE[saved["name"]])
    return OmegaConf.to_container(OmegaConf.merge(schema, {k: v for k, v in saved.items() if k in schema}))
