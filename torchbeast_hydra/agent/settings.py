"""The model group's settings: what every model has (its body class and the shared actor-critic
core's options) and one schema per body this package ships. A user's model YAML may extend
`base_model` with fields of its own: agent.models.make_model checks them against the body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from omegaconf import MISSING

from torchbeast_hydra.errors import require


@dataclass
class ModelConfig:
    """What every model has: its body class (built by Hydra's instantiate, with obs_shape and the
    body's own fields beside these as keyword arguments) and the shared actor-critic core's options
    (models.ActorCritic). A model's YAML file extends its own schema below, or `base_model` plus
    nothing; a user's model YAML may list its fields without a schema: they are checked against
    the body's constructor before anything starts (models.make_model)."""

    _target_: str = MISSING  # the body class, e.g. my_pkg.models.MyBody
    use_lstm: bool = False  # an LSTM core between the body's features and the policy and baseline heads
    lstm_layers: int = 1  # with use_lstm
    # The baseline on a body of its own (same class and fields), not sharing the policy's features:
    # the value loss then cannot pull the policy's features (continuous control). Feed-forward: with
    # use_lstm, the LSTM is the policy's.
    separate_critic: bool = False
    # PopArt: the baseline head learns values standardised by running statistics of the value targets
    # (models.ValueNorm; checkpointed), and the value loss and advantages are divided by their scale,
    # so no reward_scale has to be tuned per task. value_norm_beta: the statistics' rate per update.
    normalize_values: bool = False
    value_norm_beta: float = 0.001
    # The last action and clipped reward beside the body's features, into the core and heads, as
    # IMPALA's agents have them. false: the observation alone, as PPO's MLP policy (docs/control.md).
    feedback: bool = True
    # Box actions: the Gaussian's log standard deviation at the start (learned from there; 0: std 1,
    # CleanRL's PPO). Lower explores less at first (Andrychowicz et al. 2020 recommend std ~0.5).
    init_log_std: float = 0.0


@dataclass
class AtariNetConfig(ModelConfig):
    """TorchBeast's shallow network (3 conv layers + fc 512), for image observations."""

    _target_: str = "torchbeast_hydra.agent.models.AtariNetBody"
    lstm_layers: int = 2  # with use_lstm, as in TorchBeast
    output_size: int = 512  # features out of the fully connected layer


@dataclass
class ResNetConfig(ModelConfig):
    """The IMPALA paper's deep network (3 residual stacks of 16, 32, 32 channels + fc 256)."""

    _target_: str = "torchbeast_hydra.agent.models.ResNetBody"
    channels: List[int] = field(default_factory=lambda: [16, 32, 32])  # one residual stack each
    output_size: int = 256  # features out of the fully connected layer


@dataclass
class MLPConfig(ModelConfig):
    """A multilayer perceptron for vector observations (e.g. CartPole)."""

    _target_: str = "torchbeast_hydra.agent.models.MLPBody"
    hidden_sizes: List[int] = field(default_factory=lambda: [64, 64])  # one ReLU layer each
    normalize_obs: bool = False  # standardise observations by running statistics (checkpointed)
    activation: str = "relu"  # between layers: relu or tanh (CleanRL's PPO on MuJoCo)


@dataclass
class MultiConfig(ModelConfig):
    """One encoder per observation leaf (Dict/Tuple observations): convs for images, embeddings
    for Discrete leaves, vectors flattened; concatenated, then an MLP (encoders.MultiBody)."""

    _target_: str = "torchbeast_hydra.agent.encoders.MultiBody"
    embedding_dim: int = 16  # per Discrete entry
    conv_channels: List[int] = field(default_factory=lambda: [16, 32])  # one 3x3 conv each, for image leaves
    hidden_sizes: List[int] = field(default_factory=lambda: [256])  # ReLU layers over the concatenated features
    # Image leaves whose channels are category codes, not intensities (MiniGrid's obs/image): each
    # code embedded, a cell's embeddings summed, then the convs (encoders.CodeImageEncoder).
    code_images: List[str] = field(default_factory=list)


@dataclass
class NetHackConfig(ModelConfig):
    """NLE's baseline net for NetHack and MiniHack (encoders.NetHackBody)."""

    _target_: str = "torchbeast_hydra.agent.encoders.NetHackBody"
    embedding_dim: int = 32  # per glyph
    crop_size: int = 9  # the egocentric view around the agent
    full_map: bool = True  # convs over the whole 21x79 map too (false: the crop alone, far cheaper)
    conv_channels: List[int] = field(default_factory=lambda: [16, 16, 16, 16, 8])  # 3x3 convs, map and crop each
    stats_hidden: int = 32  # two ReLU layers over the bottom-line stats
    output_size: int = 512  # two ReLU layers over map, crop and stats
    glyphs_key: str = "obs/glyphs"
    blstats_key: str = "obs/blstats"


def check(cfg) -> None:
    """The model slice's checks (cfg.model)."""
    require(
        bool(cfg.model.get("_target_")),
        "model._target_ must name the model's body class, "
        "e.g. model._target_=my_pkg.models.MyBody (see docs/extending.md).",
    )
    require(cfg.model.get("lstm_layers", 1) >= 1, "model.lstm_layers must be at least 1.")
    beta = cfg.model.get("value_norm_beta", ModelConfig.value_norm_beta)
    require(0 < beta <= 1, f"model.value_norm_beta={beta} must be in (0, 1]: the statistics' rate per update.")
