"""Policies: a body that turns observations into features, then a shared actor-critic core.

Every model takes time-major inputs [T, B, ...] (the observation's keys: `frame`, or a Dict/Tuple
observation's leaves `obs/...`; reward, done, last_action) and returns
policy_logits [T, B, A], baseline [T, B] and (unless asked not to) action [T, B]. The core
appends the one-hot last action and the clipped reward to the features and, with use_lstm, runs
an LSTM whose state is zeroed at episode boundaries (done). To try a new architecture, write a
`Body` and a YAML file naming it (`_target_`): see the README's Extending section.
"""

from __future__ import annotations

import math

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from .config import AtariNetConfig, ConfigError, MLPConfig, ResNetConfig
from .envs import EnvSpec


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


def orthogonal_(module: nn.Module, gain: float) -> None:
    """Orthogonal weights and zero biases for every conv and linear layer in module.

    With gain sqrt(2) (ReLU's) the signal keeps its scale through the layers; torch's default
    init shrinks it at each, so that Pong's frames, which differ only in the ball and paddles,
    give features that hardly differ (36x less than here, measured): A2C's and PPO's Atari
    convention."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)


class AtariNetBody(Body):
    """TorchBeast's shallow network: three conv layers (as in the DQN Nature paper) + fc 512."""

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


class MLPBody(Body):
    """Fully connected layers over a flattened vector observation."""

    def __init__(self, obs_shape: tuple, hidden_sizes=(64, 64)):
        super().__init__()
        if not hidden_sizes:
            raise ValueError("model.hidden_sizes needs at least one layer.")
        layers, size = [], math.prod(_array_shape(obs_shape, "model=mlp"))
        for hidden in hidden_sizes:
            layers += [nn.Linear(size, hidden), nn.ReLU()]
            size = hidden
        self.layers = nn.Sequential(nn.Flatten(), *layers)
        self.output_size = size

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.layers(frames.float())


class ActorCritic(nn.Module):
    """Body -> [features, one-hot last action, clipped reward] -> optional LSTM -> heads."""

    def __init__(
        self, body: nn.Module, num_actions: int, use_lstm: bool, lstm_layers: int = 1, obs_keys: tuple = ("frame",)
    ):
        super().__init__()
        self.body = body
        self.obs_keys = tuple(obs_keys)  # ("frame",): the body takes the tensor, else a dict of leaves
        self.num_actions = num_actions
        core_size = body.output_size + num_actions + 1
        self.use_lstm = use_lstm
        if use_lstm:
            self.lstm = nn.LSTM(core_size, core_size, num_layers=lstm_layers)
        self.policy = nn.Linear(core_size, num_actions)
        self.baseline = nn.Linear(core_size, 1)
        orthogonal_(self.policy, gain=0.01)  # a near-uniform first policy, whatever the features
        orthogonal_(self.baseline, gain=1.0)

    def initial_state(self, batch_size: int = 1) -> tuple:
        if not self.use_lstm:
            return ()
        shape = (self.lstm.num_layers, batch_size, self.lstm.hidden_size)
        return (torch.zeros(shape), torch.zeros(shape))

    def forward(self, inputs: dict, core_state: tuple = (), action: str = "sample"):
        """action: "sample" from the policy, "greedy" (argmax), or "none" (the learner's pass)."""
        T, B = inputs["done"].shape[:2]
        if self.obs_keys == ("frame",):
            features = self.body(inputs["frame"].flatten(0, 1))
        else:
            features = self.body({key: inputs[key].flatten(0, 1) for key in self.obs_keys})
        last_action = F.one_hot(inputs["last_action"].flatten(0, 1), self.num_actions).float()
        reward = inputs["reward"].flatten(0, 1).clamp(-1, 1).unsqueeze(-1)
        core_input = torch.cat([features, reward, last_action], dim=-1)
        if self.use_lstm:
            core_output, core_state = self._lstm(core_input.view(T, B, -1), inputs["done"], core_state)
            core_output = core_output.flatten(0, 1)
        else:
            core_output = core_input
        policy_logits = self.policy(core_output)
        baseline = self.baseline(core_output)
        outputs = dict(policy_logits=policy_logits.view(T, B, self.num_actions), baseline=baseline.view(T, B))
        if action == "greedy":
            outputs["action"] = policy_logits.argmax(dim=-1).view(T, B)
        elif action == "sample":
            # Diverged weights (inf/NaN logits) must not crash the actors: they act uniformly
            # there, and the learner's optim.on_nonfinite decides what the run does about it.
            probs = torch.nan_to_num(F.softmax(policy_logits, dim=-1), nan=1.0, posinf=1.0)
            outputs["action"] = torch.multinomial(probs, 1).view(T, B)
        return outputs, core_state

    def _lstm(self, core_input: torch.Tensor, done: torch.Tensor, core_state: tuple):
        outputs = []
        keep = (~done.bool()).float()  # zero the state where an episode starts
        for step_input, step_keep in zip(core_input.unbind(), keep.unbind()):
            mask = step_keep.view(1, -1, 1)
            core_state = tuple(mask * s for s in core_state)
            output, core_state = self.lstm(step_input.unsqueeze(0), core_state)
            outputs.append(output)
        return torch.cat(outputs), core_state


# The core's fields of a model config; the others are the body's (models.Body).
CORE_FIELDS = ("_target_", "use_lstm", "lstm_layers")


def make_model(cfg, spec: EnvSpec) -> ActorCritic:
    """The body named by cfg._target_, built for the env's spaces, on the actor-critic core.

    A body that cannot be built for this env, takes other fields than the config gives, or
    breaks the Body contract raises ConfigError (chained to the cause, whose traceback helps).
    """
    fields = OmegaConf.to_container(OmegaConf.create(cfg) if not OmegaConf.is_config(cfg) else cfg, resolve=True)
    target = fields.get("_target_")
    if not target:
        raise ConfigError("model._target_ must name the model's body class, e.g. my_pkg.models.MyBody.")
    body_fields = {key: value for key, value in fields.items() if key not in CORE_FIELDS}
    try:
        body = hydra.utils.instantiate({"_target_": target, **body_fields}, obs_shape=spec.obs_shape, _convert_="all")
    except Exception as error:
        cause = error.__cause__ or error  # instantiate wraps the body's own error
        raise ConfigError(
            f"model {target} cannot be built for observations {spec.obs_shape} with {body_fields}: {cause}"
        ) from cause
    _check_body(body, target, spec)
    lstm = fields.get("use_lstm", False), fields.get("lstm_layers", 1)
    return ActorCritic(body, spec.num_actions, *lstm, obs_keys=spec.obs_keys)


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


# Checkpoints written before models were named by _target_ named them by model.name.
_NAMED_BEFORE = dict(atari_net=AtariNetConfig, resnet=ResNetConfig, mlp=MLPConfig)


def saved_model_config(saved: dict) -> dict:
    """The model config a checkpoint was trained with, in today's form (older ones had model.name)."""
    if "_target_" in saved or saved.get("name") not in _NAMED_BEFORE:
        return saved
    schema = OmegaConf.structured(_NAMED_BEFORE[saved["name"]])
    return OmegaConf.to_container(OmegaConf.merge(schema, {k: v for k, v in saved.items() if k in schema}))
