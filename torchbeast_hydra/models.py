"""Policies: a body that turns observations into features, then a shared actor-critic core.

Every model takes time-major inputs [T, B, ...] (frame, reward, done, last_action) and returns
policy_logits [T, B, A], baseline [T, B] and (unless asked not to) action [T, B]. The core
appends the one-hot last action and the clipped reward to the features and, with use_lstm, runs
an LSTM whose state is zeroed at episode boundaries (done). To try a new architecture, write a body.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, ModelConfig, ModelName
from .envs import EnvSpec


class AtariNetBody(nn.Module):
    """TorchBeast's shallow network: three conv layers (as in the DQN Nature paper) + fc 512."""

    def __init__(self, obs_shape: tuple):
        super().__init__()
        channels, height, width = obs_shape
        self.convs = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, kernel_size=3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = nn.Linear(flat, 512)
        self.output_size = 512

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


class ResNetBody(nn.Module):
    """The IMPALA paper's deep network: stacks of conv + max-pool + two residual blocks."""

    def __init__(self, obs_shape: tuple, channels=(16, 32, 32), output_size: int = 256):
        super().__init__()
        layers = []
        in_channels = obs_shape[0]
        for out_channels in channels:
            layers += [
                nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
                ResidualBlock(out_channels),
                ResidualBlock(out_channels),
            ]
            in_channels = out_channels
        self.stacks = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = self.stacks(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = nn.Linear(flat, output_size)
        self.output_size = output_size

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.float() / 255.0
        return F.relu(self.fc(self.stacks(x)))


class MLPBody(nn.Module):
    """Fully connected layers over a flattened vector observation."""

    def __init__(self, obs_shape: tuple, hidden_sizes=(64, 64)):
        super().__init__()
        layers, size = [], math.prod(obs_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(size, hidden), nn.ReLU()]
            size = hidden
        self.layers = nn.Sequential(nn.Flatten(), *layers)
        self.output_size = size

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.layers(frames.float())


class ActorCritic(nn.Module):
    """Body -> [features, one-hot last action, clipped reward] -> optional LSTM -> heads."""

    def __init__(self, body: nn.Module, num_actions: int, use_lstm: bool, lstm_layers: int = 1):
        super().__init__()
        self.body = body
        self.num_actions = num_actions
        core_size = body.output_size + num_actions + 1
        self.use_lstm = use_lstm
        if use_lstm:
            self.lstm = nn.LSTM(core_size, core_size, num_layers=lstm_layers)
        self.policy = nn.Linear(core_size, num_actions)
        self.baseline = nn.Linear(core_size, 1)

    def initial_state(self, batch_size: int = 1) -> tuple:
        if not self.use_lstm:
            return ()
        shape = (self.lstm.num_layers, batch_size, self.lstm.hidden_size)
        return (torch.zeros(shape), torch.zeros(shape))

    def forward(self, inputs: dict, core_state: tuple = (), action: str = "sample"):
        """action: "sample" from the policy, "greedy" (argmax), or "none" (the learner's pass)."""
        frame = inputs["frame"]
        T, B = frame.shape[:2]
        features = self.body(frame.flatten(0, 1))
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
        outputs = dict(
            policy_logits=policy_logits.view(T, B, self.num_actions), baseline=baseline.view(T, B)
        )
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


def make_model(cfg: ModelConfig, spec: EnvSpec) -> ActorCritic:
    """Builds cfg.name for the env's spaces; a model that cannot fit them raises ConfigError."""
    shape = spec.obs_shape
    name = ModelName(cfg.name)
    if name in (ModelName.atari_net, ModelName.resnet):
        if len(shape) != 3:
            raise ConfigError(
                f"model={name.value} needs image observations [channels, height, width], but the "
                f"env's observations have shape {shape}. Use model=mlp for vector observations."
            )
        try:
            body = AtariNetBody(shape) if name is ModelName.atari_net else ResNetBody(shape)
        except RuntimeError as error:
            raise ConfigError(
                f"model={name.value} does not fit observations of shape {shape} ({error}); "
                "use images of at least 36x36 (env.screen_size) or another model."
            ) from None
        lstm_layers = 2 if name is ModelName.atari_net else 1  # as in TorchBeast and the paper
    else:
        body = MLPBody(shape, cfg.hidden_sizes)
        lstm_layers = 1
    return ActorCritic(body, spec.num_actions, cfg.use_lstm, lstm_layers)
