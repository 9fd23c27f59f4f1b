"""Many envs stepped by EnvPool (C++ envs on a thread pool; pip install ".[envpool]"), for Atari
and MuJoCo ids, with envs.Environments' outputs and semantics.

Atari: the preprocessing of env/make.py from the same settings (atari_settings): no-op starts
(1 to noop_max no-op frames, as gymnasium's AtariPreprocessing draws them), frame skip with
max-pooling of the last two frames, grayscale screen_size^2 frames (OpenCV's INTER_AREA), a stack
of frame_stack that starts with copies of a game's first frame, sticky actions and the full or
minimal action set, raw rewards (the learner clips), `done` on a lost life with episodic_life while
the game goes on, `episode_return` over the whole game, and the id's episode cap in frames
(ALE's 108,000 for v5 ids) as agent steps. FIRE is pressed as Environments presses it: for one
agent step after a reset (EnvPool's own press, one frame, is off) and after a lost life, so that
games which need it (Breakout) run here too, where ale-py's native env cannot.
MuJoCo (v4 and v5 ids): the task as gymnasium has it, no preprocessing; env.make_kwargs that
EnvPool's task also takes (reset_noise_scale, ...) are passed to it.

EnvPool steps every env at once and leaves a finished env to reset on its next step; a game that
ends here is reset in the same step (a partial reset), so an ended env's frame is its next game's
first, as in Environments. tests/test_envpool.py compares the two step by step and says what
cannot be equal (each engine draws no-op counts, sticky repeats and MuJoCo's reset noise from its
own generator).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np

from torchbeast_hydra.env import layout
from torchbeast_hydra.env.actions import BOX, box_bounds, check
from torchbeast_hydra.env.make import find_spec, make_env
from torchbeast_hydra.env.native import _pad_with_first_frame, ale_game
from torchbeast_hydra.env.settings import EnvConfig, atari_settings
from torchbeast_hydra.env.spaces import EnvSpec, probe_env

FIRE = 1  # ALE's FIRE, the second action of every minimal set that has it (make.FireOnReset presses it)
NO_LIMIT = 2**31 - 1  # EnvPool's max_episode_steps when the id has no cap
# MuJoCo tasks whose first steps here agree with gymnasium's within 1e-9 (tests/test_envpool.py):
# env.engine=auto takes EnvPool for these. Ant, Humanoid and HumanoidStandup step ~5e-8 apart from
# the first step (contacts in another MuJoCo build), 1e-3 within five; they run on EnvPool only when
# env.engine=envpool names it.
TRACKED_MUJOCO = ("HalfCheetah", "Hopper", "Walker2d", "Swimmer", "InvertedPendulum", "InvertedDoublePendulum")


def installed() -> bool:
    return importlib.util.find_spec("envpool") is not None


def _task_ids() -> frozenset:
    import envpool

    return frozenset(envpool.list_all_envs())


def pool_id(cfg: EnvConfig) -> str:
    """EnvPool's id for an env config's id: 'ALE/SpaceInvaders-v5' -> 'SpaceInvaders-v5' (EnvPool
    has v5 Atari ids only; its preprocessing stands for gymnasium's v4/v5 variants alike);
    MuJoCo's ids are gymnasium's ('HalfCheetah-v5')."""
    if find_spec(cfg.id, cfg.imports).entry_point.startswith("ale_py"):
        return "".join(part.capitalize() for part in ale_game(cfg.id).split("_")) + "-v5"
    return cfg.id.rpartition(":")[2]


def _is_mujoco(cfg: EnvConfig) -> bool:
    entry = find_spec(cfg.id, cfg.imports).entry_point
    return isinstance(entry, str) and entry.startswith("gymnasium.envs.mujoco")


def _frame_cap(cfg: EnvConfig) -> int | None:
    """The id's episode cap in emulator frames: ALE's max_num_frames_per_episode, or the TimeLimit
    of make_env's raw env (it steps one frame at a time)."""
    spec = find_spec(cfg.id, cfg.imports)
    caps = [c for c in (spec.kwargs.get("max_num_frames_per_episode"), spec.max_episode_steps) if c]
    return min(caps) if caps else None


def refusal(cfg: EnvConfig) -> str | None:
    """Why EnvPool cannot reproduce Environments for this config, or None where it can."""
    if not installed():
        return 'EnvPool is not installed: pip install "torchbeast_hydra[envpool]" (checkout: pip install ".[envpool]")'
    spec = find_spec(cfg.id, cfg.imports)
    atari = isinstance(spec.entry_point, str) and spec.entry_point.startswith("ale_py")
    if not (atari or _is_mujoco(cfg)):
        return f"env.id={cfg.id!r} is neither an Atari nor a MuJoCo id; EnvPool's engine here runs those only"
    task = pool_id(cfg)
    if task not in _task_ids():
        return f"EnvPool has no {task!r} (env.id={cfg.id!r})"
    if atari:
        if cfg.make_kwargs:
            return "env.make_kwargs are ALE's arguments, which EnvPool's Atari envs do not take"
        if atari_settings(cfg).noop_max < 1:
            return "EnvPool's Atari envs always press at least one no-op at a reset: env.noop_max must be >= 1"
    else:
        unknown = set(cfg.make_kwargs) - set(_default_config(task))
        if unknown:
            return f"EnvPool's {task} does not take env.make_kwargs {sorted(unknown)}"
    if probe_env(cfg).single is False:
        return "EnvPool's engine writes one observation array; this env's observation has several leaves"
    return None


def auto_refusal(cfg: EnvConfig) -> str | None:
    """refusal(), and for env.engine=auto MuJoCo tasks beyond TRACKED_MUJOCO too."""
    reason = refusal(cfg)
    if reason is None and _is_mujoco(cfg) and pool_id(cfg).split("-")[0] not in TRACKED_MUJOCO:
        return f"EnvPool's {pool_id(cfg)} steps apart from gymnasium's (another MuJoCo build)"
    return reason


def _default_config(task: str) -> dict:
    import envpool

    return envpool.make_spec(task).config._asdict()


def pool_seed(seed: int, num_envs: int) -> int:
    """EnvPool's seed for a pool of ours: EnvPool takes an int32 and plays env i from seed + i. Ours
    may be larger (evaluation's, seeding.eval_seed, from 2**62; actors of large run seeds or of ranks
    past the first): those are hashed into the int32 range, distinct seeds staying distinct but for a
    ~1e-9 chance; seeds that fit are kept as they are."""
    if 0 <= seed and seed + num_envs <= 2**31:
        return seed
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint32)[0]) % (2**31 - num_envs)


def _make(cfg: EnvConfig, num_envs: int, seed: int, num_threads: int):
    import envpool

    kwargs = dict(num_envs=num_envs, batch_size=num_envs, num_threads=num_threads, seed=pool_seed(seed, num_envs))
    cap = _frame_cap(cfg)
    if _is_mujoco(cfg):
        kwargs.update(cfg.make_kwargs, max_episode_steps=cap or NO_LIMIT)
    else:
        atari = atari_settings(cfg)
        kwargs.update(
            stack_num=atari.frame_stack,
            frame_skip=atari.frame_skip,
            noop_max=atari.noop_max,
            img_height=atari.screen_size,
            img_width=atari.screen_size,
            gray_scale=True,
            use_inter_area_resize=True,  # OpenCV's INTER_AREA, as gymnasium's AtariPreprocessing
            episodic_life=False,  # a lost life is `done` here (EnvPoolEnvironments), never a reset
            reward_clip=False,  # raw rewards: the learner clips
            use_fire_reset=False,  # pressed by EnvPoolEnvironments for an agent step, as Environments
            repeat_action_probability=atari.sticky_action_prob,
            full_action_space=atari.full_action_space,
            max_episode_steps=math.ceil(cap / atari.frame_skip) if cap else NO_LIMIT,
        )
    return envpool.make_gymnasium(pool_id(cfg), **kwargs)


class EnvPoolEnvs:
    """Makes EnvPoolEnvironments for an env config that refusal() accepts."""

    def __init__(self, cfg: EnvConfig, num_threads: int = 1):
        self.cfg = cfg
        self.num_threads = num_threads
        self.spec = probe_env(cfg)

    def __call__(self, num_envs: int, seed: int) -> "EnvPoolEnvironments":
        return EnvPoolEnvironments(self.cfg, self.spec, num_envs, seed, self.num_threads)


def _has_fire(cfg: EnvConfig) -> bool:
    """Whether the game's action set has FIRE, from one gymnasium env (as make_env decides)."""
    env = make_env(cfg)
    try:
        return "FIRE" in env.unwrapped.get_action_meanings()
    finally:
        env.close()


class EnvPoolEnvironments:
    """num_envs envs in one EnvPool, with Environments' outputs [num_envs, ...] and semantics."""

    def __init__(self, cfg: EnvConfig, spec: EnvSpec, num_envs: int, seed: int, num_threads: int):
        self.spec = spec
        self.atari = not _is_mujoco(cfg)
        settings = atari_settings(cfg)
        self.episodic_life = self.atari and settings.episodic_life
        self.fire_on_reset = self.atari and settings.fire_reset and _has_fire(cfg)
        self.fire_after_life_loss = self.episodic_life and self.fire_on_reset
        # Environments.time_limit: the id's own cap in agent steps (MuJoCo's 1,000; None for ALE's
        # frame cap), which evaluations report as their protocol's episode cap.
        self.time_limit = find_spec(cfg.id, cfg.imports).max_episode_steps
        self._make = lambda: _make(cfg, num_envs, seed, num_threads)
        self.env = self._make()
        self._fresh = True  # no game played since the pool was made from the seed
        n = num_envs
        self.out = layout.env_outputs(spec, n)  # the rollout layout's env keys, as Environments has them
        self._frame = self.out["frame"]
        self._box = spec.actions.kind == BOX
        self._bounds = box_bounds(spec.actions) if self._box else None
        self._reward = np.zeros(n, np.float32)
        self._game_over = np.zeros(n, bool)
        self._return = np.zeros(n, np.float32)
        self._steps = np.zeros(n, np.int32)
        self._lives = np.zeros(n, np.int64)

    def __len__(self) -> int:
        return len(self._reward)

    def initial(self) -> dict:
        """The seeded starts, as Environments' initial(): a pool played since it was made is made
        again (EnvPool seeds its envs only then), so that each evaluation starts the same games."""
        if not self._fresh:
            self.env.close()
            self.env = self._make()
        self._fresh = False
        self._start_games(np.arange(len(self)))
        self.out["done"][:] = True  # the first step starts an episode, like any reset
        return self.out

    def step(self, actions: np.ndarray) -> dict:
        """actions [num_envs, *spec.actions.step_shape]; Box actions non-finite raise actions.ActionError."""
        out = self.out
        if self._box:
            check(self.spec.actions, actions, "the policy's actions")
            np.clip(actions, *self._bounds, out=out["last_action"])
        else:
            out["last_action"][:] = actions
        self._reward[:] = 0.0
        self._game_over[:] = False
        lives = self._lives.copy()
        self._take(out["last_action"], None)
        done = self._game_over.copy()
        if self.episodic_life:
            life_lost = (self._lives < lives) & ~self._game_over  # fewer lives while the game goes on
            done |= life_lost
            if self.fire_after_life_loss and life_lost.any():
                lost = np.flatnonzero(life_lost)
                self._take(np.full(len(lost), FIRE), lost)  # as Environments: one agent step of FIRE
                done |= self._game_over
        self._return += self._reward
        self._steps += 1
        out["reward"][...] = self._reward
        out["done"][...] = done
        out["episode_end"][...] = self._game_over
        out["episode_return"][...] = self._return
        out["episode_step"][...] = self._steps
        ended = np.flatnonzero(self._game_over)
        if ended.size:
            self._start_games(ended)  # an ended env's frame is its next game's first
        if self.atari:
            _pad_with_first_frame(self._frame, self._steps)
        return out

    def restart(self, i: int) -> None:
        """Abandons env i's game and starts a new one (not a replay of the first)."""
        self._start_games(np.array([i]))
        self.out["done"][i] = True
        self.out["episode_end"][i] = False

    def _record(self, obs: np.ndarray, info: dict) -> np.ndarray:
        """Writes the observations (and Atari's lives) of the envs info names; returns their ids."""
        ids = info["env_id"]
        self._frame[ids] = obs
        if self.atari:
            self._lives[ids] = info["lives"]
        return ids

    def _take(self, actions: np.ndarray, env_ids: np.ndarray | None) -> None:
        """Steps the envs env_ids (None: all) with actions; adds their rewards and game ends."""
        obs, reward, terminated, truncated, info = self.env.step(actions, _ids(env_ids))
        ids = self._record(obs, info)
        self._reward[ids] += reward
        self._game_over[ids] |= terminated | truncated

    def _start_games(self, env_ids: np.ndarray) -> None:
        """Resets env_ids' games, pressing FIRE for an agent step where make_env's FireOnReset does
        (a game that FIRE ends starts again without it, as there)."""
        self._record(*self.env.reset(_ids(env_ids)))
        if self.fire_on_reset:
            obs, _, terminated, truncated, info = self.env.step(np.full(len(env_ids), FIRE), _ids(env_ids))
            over = self._record(obs, info)[terminated | truncated]
            if over.size:
                self._record(*self.env.reset(_ids(over)))
        self._return[env_ids] = 0.0
        self._steps[env_ids] = 0
        if self.atari:  # the stack starts with copies of the game's first frame (after FIRE)
            self._frame[env_ids, :-1] = self._frame[env_ids, -1:]

    def close(self) -> None:
        self.env.close()


def _ids(env_ids: np.ndarray | None) -> np.ndarray | None:
    return None if env_ids is None else np.asarray(env_ids, np.int32)
