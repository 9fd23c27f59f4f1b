"""The env group's settings: what every env has, Atari's preprocessing, and the families' own
defaults (from env/families.py's table), with the checks that types cannot express."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from torchbeast_hydra.env.families import BY_OPTION
from torchbeast_hydra.errors import require


class Engine(enum.Enum):
    """What steps the envs of mono's actors, poly's clients and evaluations (env/engines.py)."""

    auto = "auto"  # the fastest engine a core that reproduces this env config: native, envpool, gymnasium
    gymnasium = "gymnasium"  # gymnasium envs and wrappers in Python (env/vector.py): any id
    native = "native"  # ale-py's C++ AtariVectorEnv (env/native.py): Atari ids
    envpool = "envpool"  # EnvPool's C++ envs (env/pool.py): Atari and MuJoCo ids; pip install ".[envpool]"


@dataclass
class EnvConfig:
    """What every env has; conf/env/cartpole.yaml extends it, Atari games extend AtariEnvConfig."""

    id: str = MISSING  # any gymnasium id, also gymnasium's "module:EnvId" form; each env option names its own
    # Modules to import before making envs, in every process that makes them: your gym.register calls.
    imports: List[str] = field(default_factory=list)
    # Extra keyword arguments for gymnasium.make.
    make_kwargs: Dict[str, Any] = field(default_factory=dict)
    # The observation's leaves to keep (Dict/Tuple observations), by path: e.g. [image, direction]
    # (MiniGrid: leaves out `mission`, a string), [glyphs, blstats], [inner/0]; a Dict key keeps all
    # below it. null: every leaf; a leaf that is not an array (gymnasium's Text) is then refused.
    obs_keys: Optional[List[str]] = None
    # What steps the envs (env/engines.py): auto picks ale-py's native vector env where it reproduces
    # the config (Atari), else EnvPool where it is installed and does (Atari, MuJoCo), else gymnasium.
    # Naming an engine that cannot reproduce the config is refused, with the reason.
    engine: Engine = Engine.auto


@dataclass
class AtariPreprocessing:
    """TorchBeast's Atari preprocessing (grayscale frames), declared once: both env makers
    (envs.make_env and vector_envs' native AtariVectorEnv) read it through atari_settings."""

    noop_max: int = 30  # a reset is followed by 1 to noop_max no-op frames: varied starts
    frame_skip: int = 4  # each action repeats for this many frames; the last two are max-pooled
    screen_size: int = 84  # frames are resized to screen_size x screen_size
    frame_stack: int = 4  # an observation is the last frame_stack frames
    episodic_life: bool = True  # a lost life ends the episode for learning, not for logging
    fire_reset: bool = True  # press FIRE after reset in games that need it
    sticky_action_prob: float = 0.0  # ALE's repeat_action_probability (0.25: Machado et al. 2018)
    full_action_space: bool = False  # all 18 actions instead of the game's minimal set


@dataclass
class AtariEnvConfig(AtariPreprocessing, EnvConfig):
    """An Atari game (conf/env/pong.yaml and the others): what every env has, and the preprocessing."""


@dataclass
class NetHackEnvConfig(EnvConfig):
    """NLE's tasks (env=nethack): NetHackScore-v0 or any other NLE id; pip install ".[nethack]"."""

    id: str = BY_OPTION["nethack"].default_id
    imports: List[str] = field(default_factory=lambda: [BY_OPTION["nethack"].module])  # registers NLE's ids
    # NLE computes only the observations asked for: those the NetHack model reads.
    make_kwargs: Dict[str, Any] = field(default_factory=lambda: {"observation_keys": ["glyphs", "blstats"]})


@dataclass
class MiniHackEnvConfig(EnvConfig):
    """MiniHack's tasks (env=minihack): any MiniHack id; pip install ".[minihack]"."""

    id: str = BY_OPTION["minihack"].default_id
    imports: List[str] = field(default_factory=lambda: [BY_OPTION["minihack"].module])
    make_kwargs: Dict[str, Any] = field(default_factory=lambda: {"observation_keys": ["glyphs", "blstats"]})


@dataclass
class MiniGridEnvConfig(EnvConfig):
    """MiniGrid's tasks (env=minigrid): any MiniGrid id; pip install ".[minigrid]"."""

    id: str = BY_OPTION["minigrid"].default_id
    imports: List[str] = field(default_factory=lambda: [BY_OPTION["minigrid"].module])
    # The 7x7 view's (object, colour, state) codes and the agent's heading; `mission` is a string.
    obs_keys: Optional[List[str]] = field(default_factory=lambda: ["image", "direction"])


def atari_settings(env_cfg) -> AtariPreprocessing:
    """The Atari preprocessing of any env config: its own settings, the defaults for those its schema
    lacks (e.g. env.id=ALE/Breakout-v5 typed on env=cartpole, whose schema has none)."""
    given = {f.name: getattr(env_cfg, f.name) for f in fields(AtariPreprocessing) if hasattr(env_cfg, f.name)}
    return AtariPreprocessing(**given)


def check(cfg) -> None:
    """The env slice's checks (cfg.env)."""
    atari = atari_settings(cfg.env)
    require(atari.frame_stack >= 1 and atari.frame_skip >= 1, "env.frame_stack and env.frame_skip must be >= 1.")
    require(0.0 <= atari.sticky_action_prob <= 1.0, "env.sticky_action_prob must be in [0, 1].")
    require(atari.noop_max >= 0, "env.noop_max must be >= 0.")
    require(atari.screen_size >= 1, "env.screen_size must be at least 1.")
