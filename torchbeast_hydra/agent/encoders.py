"""Bodies for Dict/Tuple observations (models.Body's second form: a dict of leaves in).

- `MultiBody` (model=multi): one encoder per leaf, chosen from the leaf's space, features
  concatenated and passed through a small MLP. Images (3-D Boxes, either channel order, uint8 or
  float; 2-D Boxes as one channel) go through a small conv net; Discrete and MultiDiscrete leaves
  through embeddings; other Boxes and MultiBinary leaves are flattened.
- `NetHackBody` (model=nethack): NLE's baseline agent (facebookresearch/nle, `NetHackNet`) for
  NetHack and MiniHack: embedded glyphs, a conv net over the whole map, a conv net over a crop
  around the agent (whose x, y are the first two bottom-line stats), an MLP over the stats.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torchbeast_hydra.agent.models import Body, orthogonal_


def _leaf_spaces(obs_shape, model: str) -> dict:
    if not isinstance(obs_shape, dict):
        raise ValueError(
            f"{model} takes Dict/Tuple observations, but this env's is one array of shape {tuple(obs_shape)}: "
            "use model=mlp (vectors) or model=atari_net (images)."
        )
    return obs_shape


# Bounds farther apart than this describe no real range (NLE's stats declare int32's, many envs
# float32's largest): scaled by them, every value would come out the same.
MAX_SCALED_RANGE = 1e4


def _bounds(space: gym.spaces.Box):
    """(low, high - low) as tensors of the leaf's shape when every bound is finite and the range
    at most MAX_SCALED_RANGE, else None."""
    low, high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
    if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high <= low).any():
        return None
    if (high - low > MAX_SCALED_RANGE).any():
        return None
    return torch.as_tensor(low, dtype=torch.float32), torch.as_tensor(high - low, dtype=torch.float32)


def symlog(x: torch.Tensor) -> torch.Tensor:
    """sign(x) log(1 + |x|): near x for small values, so that large counters (gold, turns, score)
    do not dominate."""
    return x.sign() * torch.log1p(x.abs())


class BoxEncoder(nn.Module):
    """A Box leaf, scaled to [0, 1] by its bounds where they give a range (uint8 images: / 255),
    else squashed by symlog."""

    def __init__(self, space: gym.spaces.Box):
        super().__init__()
        bounds = _bounds(space)
        self.scaled = bounds is not None
        if self.scaled:
            self.register_buffer("low", bounds[0], persistent=False)
            self.register_buffer("range", bounds[1], persistent=False)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (x - self.low) / self.range if self.scaled else symlog(x)


class VectorEncoder(BoxEncoder):
    """A Box of any other shape (or MultiBinary): flattened."""

    def __init__(self, space: gym.Space):
        super().__init__(space if isinstance(space, gym.spaces.Box) else gym.spaces.Box(0, 1, space.shape))
        self.output_size = max(1, math.prod(space.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x).reshape(len(x), -1)


def _image_layout(shape: tuple) -> tuple:
    """(channels_last, in_channels, (height, width)) of a 2-D or 3-D image leaf. The channel axis is
    the smaller end: (7, 7, 3) is channels-last, (4, 84, 84) channels-first."""
    if len(shape) == 2:
        return False, 1, tuple(shape)
    channels_last = shape[-1] < shape[0]
    return channels_last, (shape[-1] if channels_last else shape[0]), tuple(shape[:2] if channels_last else shape[1:])


def _conv_net(in_channels: int, hw: tuple, channels) -> tuple:
    """3x3 ReLU convs (stride 2 for images larger than 16x16), flattened; and their output size."""
    stride = 2 if min(hw) > 16 else 1
    layers, size = [], in_channels
    for out in channels:
        layers += [nn.Conv2d(size, out, 3, stride=stride, padding=1), nn.ReLU()]
        size = out
    convs = nn.Sequential(*layers, nn.Flatten())
    with torch.no_grad():
        return convs, convs(torch.zeros(1, in_channels, *hw)).shape[1]


def _channels_first(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if x.dim() == 3:
        return x.unsqueeze(1)
    return x.permute(0, 3, 1, 2) if channels_last else x


class ImageEncoder(BoxEncoder):
    """A 2-D or 3-D Box of intensities (pixels, uint8 or float) through a small conv net."""

    def __init__(self, space: gym.spaces.Box, channels=(16, 32)):
        super().__init__(space)
        self.channels_last, in_channels, hw = _image_layout(space.shape)
        self.convs, self.output_size = _conv_net(in_channels, hw, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convs(_channels_first(self.scale(x), self.channels_last))


class CodeImageEncoder(nn.Module):
    """An image whose channels hold category codes, not intensities (MiniGrid's cells: object,
    colour, state). Scaled as pixels, codes 0..10 of 255 would all look black and their order
    would mean something it does not; instead each channel's code is embedded and a cell's
    embeddings are summed (BabyAI's bag-of-words image embedding), then the conv net."""

    def __init__(self, space: gym.spaces.Box, embedding_dim: int, channels=(16, 32)):
        super().__init__()
        self.channels_last, in_channels, hw = _image_layout(space.shape)
        codes = int(np.max(space.high)) + 1
        self.register_buffer("offsets", torch.arange(in_channels) * codes, persistent=False)
        self.limit = codes - 1
        self.embedding = nn.Embedding(codes * in_channels, embedding_dim)
        self.convs, self.output_size = _conv_net(embedding_dim, hw, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = _channels_first(x, self.channels_last).long().clamp(0, self.limit)
        ids = codes + self.offsets[:, None, None]  # (N, C, H, W): each channel its own part of the table
        return self.convs(self.embedding(ids).sum(1).permute(0, 3, 1, 2))


class DiscreteEncoder(nn.Module):
    """A Discrete or MultiDiscrete leaf: one embedding per entry (offsets share one table)."""

    def __init__(self, space: gym.Space, embedding_dim: int):
        super().__init__()
        sizes = np.asarray([space.n] if isinstance(space, gym.spaces.Discrete) else space.nvec, np.int64).ravel()
        starts = np.broadcast_to(np.asarray(space.start, np.int64).ravel(), sizes.shape)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) - starts
        self.register_buffer("offsets", torch.as_tensor(offsets), persistent=False)
        self.register_buffer("limit", torch.as_tensor(np.cumsum(sizes) - 1), persistent=False)
        self.embedding = nn.Embedding(int(sizes.sum()), embedding_dim)
        self.output_size = embedding_dim * len(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.reshape(len(x), -1).long() + self.offsets
        # Ids out of range (never from a checked env; dummy zeros) stay inside the table.
        ids = torch.minimum(ids.clamp(min=0), self.limit)
        return self.embedding(ids).reshape(len(x), -1)


def _is_image(space: gym.Space) -> bool:
    if not isinstance(space, gym.spaces.Box) or len(space.shape) not in (2, 3):
        return False
    _, _, hw = _image_layout(space.shape)
    return min(hw) >= 3


def leaf_encoder(space: gym.Space, embedding_dim: int, conv_channels, codes: bool = False) -> nn.Module:
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        return DiscreteEncoder(space, embedding_dim)
    if _is_image(space):
        return CodeImageEncoder(space, embedding_dim, conv_channels) if codes else ImageEncoder(space, conv_channels)
    return VectorEncoder(space)


class MultiBody(Body):
    """One encoder per observation leaf, by its space; features concatenated, then an MLP."""

    def __init__(self, obs_shape, embedding_dim: int = 16, conv_channels=(16, 32), hidden_sizes=(256,), code_images=()):
        super().__init__()
        spaces = _leaf_spaces(obs_shape, "model=multi")
        unknown = [key for key in code_images if key not in spaces]
        if unknown:
            raise ValueError(f"model.code_images names {unknown}, not leaves of this env's observation: {list(spaces)}")
        not_images = [key for key in code_images if not _is_image(spaces[key])]
        if not_images:
            raise ValueError(f"model.code_images takes image leaves (2-D or 3-D Boxes); {not_images} are not")
        self.keys = list(spaces)
        # ModuleDict keys cannot hold "/" or "."; the leaves keep their order.
        self.encoders = nn.ModuleList(
            leaf_encoder(spaces[k], embedding_dim, conv_channels, codes=k in code_images) for k in self.keys
        )
        size = sum(e.output_size for e in self.encoders)
        layers = []
        for hidden in hidden_sizes:
            layers += [nn.Linear(size, hidden), nn.ReLU()]
            size = hidden
        self.mlp = nn.Sequential(*layers)
        self.output_size = size
        orthogonal_(self, gain=math.sqrt(2))

    def forward(self, obs: dict) -> torch.Tensor:
        features = [encoder(obs[key]) for key, encoder in zip(self.keys, self.encoders)]
        return self.mlp(torch.cat(features, dim=-1))


def _conv_stack(in_channels: int, channels) -> nn.Sequential:
    layers = []
    for out in channels:
        layers += [nn.Conv2d(in_channels, out, kernel_size=3, padding=1), nn.ELU()]
        in_channels = out
    return nn.Sequential(*layers)


DUNGEON_SHAPE = (21, 79)  # NetHack's map, in rows and columns (nle.nethack.DUNGEON_SHAPE)


class NetHackBody(Body):
    """NLE's baseline net: glyph embedding; convs over the full map and over a crop centred on the
    agent; an MLP over the bottom-line stats; two fully connected layers over all three.

    full_map=False drops the map's convs: the agent sees only its crop (egocentric: the same goal
    in the same place relative to the agent looks the same wherever it stands), which is most of a
    step's cost saved; a crop of 2k-1 covers a k x k room from any cell of it."""

    # Its convs (over the 21x79 map, or the crop alone) are most of a step's cost; bf16 paid for both
    # on Zen 4 (learner pass, batch 256: the default net 1.35 -> 0.73 ms a sample; experiment=minihack's
    # 29x29 crop alone 0.30 -> 0.20).
    bf16_on_cpu = True

    def __init__(
        self,
        obs_shape,
        embedding_dim: int = 32,
        crop_size: int = 9,
        conv_channels=(16, 16, 16, 16, 8),
        stats_hidden: int = 32,
        output_size: int = 512,
        glyphs_key: str = "obs/glyphs",
        blstats_key: str = "obs/blstats",
        full_map: bool = True,
    ):
        super().__init__()
        spaces = _leaf_spaces(obs_shape, "model=nethack")
        for key in (glyphs_key, blstats_key):
            if key not in spaces:
                raise ValueError(
                    f"model=nethack needs the leaves {glyphs_key} and {blstats_key}; this env has {list(spaces)} "
                    "(NLE/MiniHack: env.make_kwargs.observation_keys must include glyphs and blstats)."
                )
        glyphs, blstats = spaces[glyphs_key], spaces[blstats_key]
        if tuple(glyphs.shape) != DUNGEON_SHAPE:  # the crop is taken at the agent's map position
            raise ValueError(
                f"model=nethack crops {glyphs_key} around the agent's map position (blstats[0:2]), so it must "
                f"be the whole {DUNGEON_SHAPE[0]}x{DUNGEON_SHAPE[1]} map, not {list(glyphs.shape)}."
            )
        if not conv_channels or crop_size < 1:
            raise ValueError(f"model=nethack needs conv_channels (got {list(conv_channels)}) and crop_size >= 1.")
        self.glyphs_key, self.blstats_key, self.crop_size = glyphs_key, blstats_key, crop_size
        height, width = glyphs.shape
        self.embedding = nn.Embedding(int(np.max(glyphs.high)) + 1, embedding_dim)
        self.map_convs = _conv_stack(embedding_dim, conv_channels) if full_map else None
        self.crop_convs = _conv_stack(embedding_dim, conv_channels)
        num_stats = blstats.shape[0]
        self.stats_mlp = nn.Sequential(
            nn.Linear(num_stats, stats_hidden), nn.ReLU(), nn.Linear(stats_hidden, stats_hidden), nn.ReLU()
        )
        cells = (height * width if full_map else 0) + crop_size * crop_size
        size = conv_channels[-1] * cells + stats_hidden
        self.fc = nn.Sequential(nn.Linear(size, output_size), nn.ReLU(), nn.Linear(output_size, output_size), nn.ReLU())
        self.output_size = output_size

    def crop(self, glyphs: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The crop_size x crop_size glyph ids centred on (x, y); glyph 0 beyond the map's edge."""
        r = self.crop_size // 2
        padded = F.pad(glyphs, (r, r, r, r))
        offsets = torch.arange(self.crop_size, device=glyphs.device)
        rows = (y.clamp(0, glyphs.shape[1] - 1)[:, None] + offsets)[:, :, None]
        cols = (x.clamp(0, glyphs.shape[2] - 1)[:, None] + offsets)[:, None, :]
        return padded[torch.arange(len(glyphs), device=glyphs.device)[:, None, None], rows, cols]

    def forward(self, obs: dict) -> torch.Tensor:
        glyphs = obs[self.glyphs_key].long()
        blstats = obs[self.blstats_key]
        crop = self.crop(glyphs, blstats[:, 0].long(), blstats[:, 1].long())
        near = self.crop_convs(self.embedding(crop).permute(0, 3, 1, 2)).flatten(1)
        stats = self.stats_mlp(symlog(blstats.float()))  # counters of any size: gold, turns, score
        if self.map_convs is None:
            return self.fc(torch.cat([near, stats], dim=-1))
        full = self.map_convs(self.embedding(glyphs).permute(0, 3, 1, 2)).flatten(1)
        return self.fc(torch.cat([full, near, stats], dim=-1))
