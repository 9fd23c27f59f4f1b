"""Making one env: any gymnasium id, with TorchBeast's Atari preprocessing for ALE games.

The preprocessing's settings are declared once, in env.settings.AtariPreprocessing (env.noop_max,
env.frame_skip, ...); `make_env` reads them through atari_settings, as the native vector env does
(env/native.py), so both give the agent the same observations (tests/test_atari_parity.py).
Non-Atari ids ignore them.

Your own envs: list the modules that register them in `env.imports` (or use gymnasium's
`module:EnvId` form for env.id); every process that makes envs (the learner's probe, mono actors,
poly clients here or on other machines) imports them first. An id of a family this package offers
an extra for (env/families.py) typed without its env option is refused with the option to use.
"""

from __future__ import annotations

import difflib
import importlib
import sys

import gymnasium as gym
import numpy as np

from torchbeast_hydra.env import families
from torchbeast_hydra.env.settings import EnvConfig, atari_settings
from torchbeast_hydra.errors import ConfigError


def _register_ale() -> None:
    try:
        import ale_py

        gym.register_envs(ale_py)
    except ImportError:  # Atari is optional for non-Atari ids
        pass


_register_ale()


def import_modules(modules, what: str = "env.imports") -> None:
    """Imports the modules that register a user's envs (their gym.register calls run once)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            family = families.BY_MODULE.get(module.split(".")[0])
            if family and getattr(error, "name", None) == family.module:
                extra = family.option
                raise ConfigError(
                    f'{what}: {module!r} is not installed; install it with: pip install "torchbeast_hydra[{extra}]" '
                    f'(from a checkout: pip install ".[{extra}]").'
                ) from error
            raise ConfigError(
                f"{what}: cannot import {module!r} ({error}). Install it in this environment or put "
                "its directory on PYTHONPATH (on every machine that runs env clients)."
            ) from error


def find_spec(env_id: str, imports=()) -> gym.envs.registration.EnvSpec:
    """The registered spec of env_id, after importing `imports` and, for "module:EnvId", module."""
    import_modules(imports)
    module, sep, name = env_id.rpartition(":")
    if sep:
        import_modules([module], what=f"env.id={env_id!r}")
    try:
        return gym.spec(name)
    except gym.error.Error as error:
        raise _unknown_env_error(name, error, imports) from None


def is_atari(env_id: str, imports=()) -> bool:
    return _is_ale(find_spec(env_id, imports))


def _is_ale(spec: gym.envs.registration.EnvSpec) -> bool:
    return isinstance(spec.entry_point, str) and spec.entry_point.startswith("ale_py")


def _unknown_env_error(env_id: str, error: Exception, imports=()) -> ConfigError:
    family = families.family_of_id(env_id)
    if family is not None and family.module not in imports:
        option = family.option
        return ConfigError(
            f"env.id={env_id!r} is one of env={option}'s ids; that option registers them and brings "
            f"their model: python -m torchbeast_hydra env={option} env.id={env_id} "
            f'(after pip install ".[{option}]").'
        )
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(
        f"env.id={env_id!r} is not a registered gymnasium environment ({error}).{hint} "
        "Your own envs: list the modules that register them in env.imports, or use env.id=module:EnvId. "
        "List ids with: python -c 'import gymnasium, ale_py; gymnasium.pprint_registry()'"
    )


class FireOnReset(gym.Wrapper):
    """Presses FIRE after a reset, for games that wait for it before play starts."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self.env.step(1)
        if terminated or truncated:
            obs, info = self.env.reset(**kwargs)
        return obs, info


class SeededNetHack(gym.Wrapper):
    """NLE's games (NetHack, MiniHack) drawn from the reset's seed. NLE's reset(seed=...) seeds only
    gymnasium's generator; each game's own RNGs came from the OS, so no run or evaluation replayed.
    Every reset now sets the next game's core and display seeds (NetHack's anti-TAS reseeding off)
    from a generator that the seeded reset starts: the same first seed, the same games in turn."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._games = None

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self._games = np.random.default_rng(seed)
        if self._games is not None:
            core, disp = (int(x) for x in self._games.integers(0, 2**62, size=2))
            self.env.unwrapped.seed(core, disp, reseed=False)
        return self.env.reset(seed=seed, options=options)


def _is_nethack(env: gym.Env) -> bool:
    nle_base = sys.modules.get("nle.env.base")  # imported by whatever registered an NLE env
    return nle_base is not None and isinstance(env.unwrapped, nle_base.NLE)


# gymnasium's tasks whose simulator is an extra of ours (pyproject.toml): a word of gymnasium's
# DependencyNotInstalled message -> the extra.
SIMULATOR_EXTRAS = {"mujoco": "mujoco", "box2d": "box2d"}


def make_env(cfg: EnvConfig, render_mode: str | None = None) -> gym.Env:
    """One gymnasium env for cfg.id; Atari ids get TorchBeast's preprocessing."""
    spec = find_spec(cfg.id, cfg.imports)
    kwargs = dict(cfg.make_kwargs)
    if render_mode is not None:  # only when asked: a user's env need not take the argument
        kwargs["render_mode"] = render_mode
    atari = atari_settings(cfg) if _is_ale(spec) else None
    if atari is not None:
        # Frame skipping and max-pooling happen in AtariPreprocessing, so the raw env must not skip.
        kwargs.update(
            frameskip=1,
            repeat_action_probability=atari.sticky_action_prob,
            full_action_space=atari.full_action_space,
        )
    try:
        env = gym.make(spec, **kwargs)
    except gym.error.DependencyNotInstalled as error:
        extra = next((extra for word, extra in SIMULATOR_EXTRAS.items() if word in str(error).lower()), None)
        if extra is not None:  # gymnasium's own advice (gymnasium[box2d] builds box2d-py with swig) is not ours
            raise ConfigError(
                f'env.id={cfg.id!r} needs the {extra} extra: pip install "torchbeast_hydra[{extra}]" '
                f'(in a checkout: pip install ".[{extra}]").'
            ) from None
        raise ConfigError(f"could not create env.id={cfg.id!r}: {error}") from None
    except gym.error.Error as error:
        raise ConfigError(f"could not create env.id={cfg.id!r}: {error}") from None
    except Exception as error:  # e.g. a missing ROM, an unknown keyword, a bug in your env
        # Chained, so that the error's traceback (inside your env, say) follows this line in the log.
        raise ConfigError(
            f"could not create env.id={cfg.id!r}: {type(error).__name__}: {error}. "
            "Check env.id and env.make_kwargs (the traceback follows); Atari ROMs ship with ale-py>=0.9."
        ) from error
    if atari is not None:
        env = gym.wrappers.AtariPreprocessing(
            env,
            noop_max=atari.noop_max,
            frame_skip=atari.frame_skip,
            screen_size=atari.screen_size,
            terminal_on_life_loss=False,  # handled by Environments, without resetting the game
            grayscale_obs=True,
            scale_obs=False,  # uint8 frames: 4x less memory in buffers and on the wire
        )
        if atari.fire_reset and "FIRE" in env.unwrapped.get_action_meanings():
            env = FireOnReset(env)
        env = gym.wrappers.FrameStackObservation(env, atari.frame_stack)
    if _is_nethack(env):
        env = SeededNetHack(env)
    return env
