"""Which engine steps an env config's envs (env.engine), for mono's actors, poly's clients and
evaluations alike: every engine gives envs.Environments' outputs and semantics.

- gymnasium (env/vector.py): gymnasium envs and wrappers in Python; any id.
- native (env/native.py): ale-py's C++ AtariVectorEnv; Atari games but those that need FIRE
  after a lost life.
- envpool (env/pool.py): EnvPool's C++ envs; Atari (all games) and MuJoCo, when installed.

auto takes the first of AUTO_ORDER that reproduces the config, the fastest a core first: on the
2-core box (`python benchmarks/throughput.py envs`, docs/performance.md) ale-py's vector env stepped
Pong ~10% faster a core than EnvPool (EnvPool's caller waits on its worker thread), and EnvPool
stepped Breakout (which the native env cannot run) and MuJoCo 1.3-1.6x as fast as gymnasium.
A named engine that cannot reproduce the config is refused with the reason.
"""

from __future__ import annotations

from torchbeast_hydra.env import native, pool
from torchbeast_hydra.env.settings import Engine, EnvConfig
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.errors import ConfigError

AUTO_ORDER = (Engine.native, Engine.envpool, Engine.gymnasium)

_MAKERS = {
    Engine.gymnasium: lambda cfg, threads: native.GymnasiumEnvs(cfg),
    Engine.native: native.AtariVectorEnvs,
    Engine.envpool: pool.EnvPoolEnvs,
}
_REFUSALS = {Engine.gymnasium: lambda cfg: None, Engine.native: native.refusal, Engine.envpool: pool.refusal}


def engine_of(cfg: EnvConfig, vector_env: bool = True) -> Engine:
    """The engine for an env config: env.engine, or for auto the first of AUTO_ORDER that
    reproduces it (vector_env=False, backend.vector_env: gymnasium). Raises ConfigError where the
    engine named cannot reproduce the config."""
    engine = Engine(getattr(cfg, "engine", Engine.auto))
    if engine is Engine.auto:
        if not vector_env:
            return Engine.gymnasium
        return next(e for e in AUTO_ORDER if _REFUSALS[e](cfg) is None)
    reason = _REFUSALS[engine](cfg)
    if reason is not None:
        raise ConfigError(f"env.engine={engine.value}: {reason}. Use env.engine=auto (or gymnasium).")
    return engine


def envs_maker(cfg: EnvConfig, num_threads: int = 1, vector_env: bool = True):
    """The env maker (maker(num_envs, seed) -> envs) for mono's actors and poly's clients, each
    engine's envs on num_threads threads where it has any."""
    return _MAKERS[engine_of(cfg, vector_env)](cfg, num_threads)


def evaluation_envs(cfg: EnvConfig, num_envs: int, seed: int, render_mode: str | None = None):
    """Envs for evaluations (mode=test, the periodic ones): EnvPool's where it is the engine that
    trains (the same engine plays and scores), else gymnasium's (Environments), which a video
    needs (it renders) and which stands in for ale-py's vector env (it cannot restart one env)."""
    if render_mode is None and engine_of(cfg) is Engine.envpool:
        return pool.EnvPoolEnvs(cfg)(num_envs, seed)
    return Environments(cfg, num_envs, seed=seed, render_mode=render_mode)
