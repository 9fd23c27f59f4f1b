"""A model for the benchmarks' own probes (benchmarks/conf/model/): cheap by design."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from torchbeast_hydra.agent.models import Body


class TrivialFrames(Body):
    """Image frames [N, C, H, W] read at a grid x grid of pixels per channel, then one ReLU layer.
    Any model that reads every pixel costs tens of microseconds a step on a CPU (converting 28,224
    bytes of a Pong observation to floats alone does), and the learner's process would measure
    that, not the server."""

    def __init__(self, obs_shape, grid: int = 4, width: int = 32):
        super().__init__()
        channels, height, width_px = obs_shape
        self.stride = (max(1, height // grid), max(1, width_px // grid))
        cells = len(range(0, height, self.stride[0])) * len(range(0, width_px, self.stride[1]))
        self.fc = nn.Linear(channels * cells, width)
        self.output_size = width

    def forward(self, frames):
        pixels = frames[:, :, :: self.stride[0], :: self.stride[1]].float() / 255.0
        return F.relu(self.fc(pixels.flatten(1)))
