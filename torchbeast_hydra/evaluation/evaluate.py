"""Test mode: play a trained run's checkpoint for N episodes and report the returns.

The test command has a run dir of its own (Hydra's, as for training): its log, `eval.csv`,
`videos/`, and `trained_run`, a link to the run whose checkpoint it played. The trained run's
dir is only read; started in that dir (no load_dir), test mode plays and writes there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from omegaconf import OmegaConf

from torchbeast_hydra.agent.models import make_model, saved_model_config
from torchbeast_hydra.env.actions import random_actions
from torchbeast_hydra.env.engines import evaluation_envs
from torchbeast_hydra.env.make import is_atari
from torchbeast_hydra.env.settings import AtariEnvConfig, EnvConfig, atari_settings
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.logs.metrics import TRAINED_RUN_LINK, CsvLog
from torchbeast_hydra.logs.wandb_log import RUN_ID_FILE, WandbLog
from torchbeast_hydra.run import checkpoint
from torchbeast_hydra.run.seeding import eval_seed

log = logging.getLogger(__name__)

# What an evaluation measured; the rest of its eval.csv row says how (the protocol).
EVAL_FIGURES = ("episodes", "mean_return", "std_return", "min_return", "max_return", "mean_length", "seconds")


@dataclass(frozen=True)
class Rules:
    """How games are played: how many, cut where, argmax actions (with a random one at epsilon's
    rate) or sampled ones. mode=test's come from test.*, evaluations during training take eval.episodes
    and eval.greedy instead."""

    episodes: int
    max_episode_steps: int = 27_000  # ALE's own cap: 108,000 frames at frame skip 4
    greedy: bool = True
    epsilon: float = 0.0

    @classmethod
    def of_test(cls, test) -> Rules:
        """mode=test's rules (cfg.test: TestConfig)."""
        return cls(test.num_episodes, test.max_episode_steps, test.greedy, test.epsilon)

    @property
    def action(self) -> str:
        """The model's action mode."""
        return "greedy" if self.greedy else "sample"


def evaluate(cfg, trained_dir: Path, out_dir: Path) -> dict:
    """Loads trained_dir's checkpoint and plays cfg.test.num_episodes whole games; returns the figures,
    which go to out_dir (eval.csv, videos/, the log).

    The games are played as the agent was trained (the same preprocessing and life-loss handling:
    FIRE after a lost life, the LSTM state reset), and scored as papers do: the whole game's
    return, all lives, capped at test.max_episode_steps (ALE's 108,000 frames).
    """
    trained_dir = trained_dir.resolve()
    state = checkpoint.load(checkpoint.path_in(trained_dir))
    link_trained_run(out_dir, trained_dir)
    log.info("Evaluating %s (step %d); results in %s", trained_dir, state["step"], out_dir)
    env_cfg = eval_env_config(cfg, state)
    # The trained run's model, whatever this invocation's defaults say.
    model_cfg = saved_model_config(state["config"]["model"])
    record = cfg.test.record_video
    if record:
        headless_rendering()
    # Life losses as in training: FIRE after one where the game needs it, and `done` for the model.
    # Evaluation seeds (seeding.eval_seed), never a training env's: the same starts as the periodic
    # evaluations of a run with this seed, and no episode any run's actors played.
    seed = eval_seed(cfg.seed)
    envs = evaluation_envs(env_cfg, 1, seed, render_mode="rgb_array" if record else None)
    if record:
        envs.envs[0] = _record_video(envs.envs[0], out_dir / "videos", cfg.test.num_episodes)
    model = make_model(model_cfg, envs.spec, initialise=False)
    model.load_state_dict(state["learner"]["model"])
    model.eval()
    torch.manual_seed(cfg.seed)

    started = time.monotonic()
    rules = Rules.of_test(cfg.test)
    try:
        returns, lengths = play(model, envs, rules, seed)
    finally:
        envs.close()
    result = dict(
        step=state["step"],
        **figures(returns, lengths, time.monotonic() - started),
        **protocol(env_cfg, envs, rules),
        seed=seed,
        trained_run=str(trained_dir),
    )
    _append_row(out_dir / "eval.csv", result)
    _log_to_wandb(
        cfg, trained_dir, out_dir, result, list((out_dir / "videos").glob("test-episode-*.mp4")) if record else []
    )
    log.info(
        f"Mean return over {len(returns)} episodes: {result['mean_return']:.2f} "
        f"± {result['std_return']:.2f} (min {result['min_return']:.1f}, max {result['max_return']:.1f}) "
        f"at step {state['step']}."
    )
    return result


def trained_runs(trained_dir: Path) -> list[Path]:
    """The runs to evaluate: trained_dir, or each job of a sweep dir that has a checkpoint."""
    if checkpoint.path_in(trained_dir).exists():
        return [trained_dir]
    jobs = sorted(p.parent for p in Path(trained_dir).glob(f"*/{checkpoint.FILENAME}"))
    if not jobs:
        raise ConfigError(f"load_dir={trained_dir}: no {checkpoint.FILENAME} there, nor in a job dir of a sweep there.")
    return jobs


def evaluate_all(cfg, trained_dir: Path, out_dir: Path) -> list[dict]:
    """Evaluates a run, or every job of a sweep (each into out_dir/JOB, named as the sweep named it)."""
    with one_torch_thread():
        return _evaluate_all(cfg, trained_dir, out_dir)


@contextlib.contextmanager
def one_torch_thread():
    """One intra-op thread while the policy plays one env (as the evaluation process during training
    does): at a batch of one a second thread gains little, and where the cores are busy (a training
    run beside it) its spin-waits slow every forward pass: the Atari net's took 9-24 ms with two
    threads against 2.2-2.4 ms with one on the 2-core box, a training run taking both cores.
    The count is restored after: a sweeper may run test mode in its own process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _evaluate_all(cfg, trained_dir: Path, out_dir: Path) -> list[dict]:
    runs = trained_runs(trained_dir)
    if runs == [trained_dir]:
        return [evaluate(cfg, trained_dir, out_dir)]
    log.info("Evaluating the %d jobs of the sweep %s.", len(runs), trained_dir)
    results = []
    for job in runs:
        (out_dir / job.name).mkdir(parents=True, exist_ok=True)
        results.append(evaluate(cfg, job, out_dir / job.name))
    return results


def eval_env_config(cfg, state: dict) -> EnvConfig:
    """The trained run's env, with test mode's protocol (sticky actions) on top."""
    return with_test_protocol(cfg, state["config"]["env"])


def figures(returns: list, lengths: list, seconds: float) -> dict:
    """What an evaluation measured (EVAL_FIGURES)."""
    return dict(
        episodes=len(returns),
        mean_return=statistics.fmean(returns),
        std_return=statistics.pstdev(returns),
        min_return=min(returns),
        max_return=max(returns),
        mean_length=statistics.fmean(lengths),
        seconds=round(seconds, 2),
    )


def protocol(env_cfg, envs: Environments, rules: Rules) -> dict:
    """How an evaluation played, so that figures from different protocols are never mixed up."""
    atari = atari_settings(env_cfg) if is_atari(env_cfg.id, env_cfg.imports) else None
    return dict(
        greedy=rules.greedy,
        epsilon=rules.epsilon if rules.greedy else "",
        sticky_action_prob=atari.sticky_action_prob if atari else "",
        max_episode_steps=episode_cap(envs, rules),
        episodic_life=envs.episodic_life,
        noop_max=atari.noop_max if atari else "",
    )


def episode_cap(envs: Environments, rules: Rules) -> int:
    """Where a game is cut: the env's own time limit where it comes first (CartPole-v1's 500 steps,
    not test.max_episode_steps, ALE's 27,000)."""
    limit = envs.time_limit
    return rules.max_episode_steps if limit is None else min(limit, rules.max_episode_steps)


def with_test_protocol(cfg, env_cfg: dict) -> EnvConfig:
    """An env config (plain data) with test mode's protocol (test.sticky_action_prob) on top.

    Read with the Atari schema whatever the id: a run's saved env may hold the Atari settings
    (older runs saved them for every env) or not; non-Atari ids ignore them.
    """
    merged = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AtariEnvConfig), env_cfg))
    if cfg.test.sticky_action_prob is not None:
        merged.sticky_action_prob = cfg.test.sticky_action_prob
    return merged


def play(model, envs: Environments, rules: Rules, seed: int = 0):
    """Plays env 0 of envs for rules.episodes games; returns (returns, lengths).

    A game cut at rules.max_episode_steps counts with the return it had, and the next one starts
    from a fresh reset (never a replay of the first game: the env's RNG goes on). Greedy play takes
    a uniformly random action at rules.epsilon's rate, drawn from a generator seeded by seed.
    """
    explore = np.random.default_rng(seed) if rules.greedy and rules.epsilon > 0 else None
    returns, lengths = [], []
    env_output = {key: torch.from_numpy(array).unsqueeze(0) for key, array in envs.initial().items()}
    core_state = model.initial_state(1)
    while len(returns) < rules.episodes:
        with torch.no_grad():
            agent_output, core_state = model(env_output, core_state, action=rules.action)
        actions = agent_output["action"][0].numpy()
        if explore is not None and explore.random() < rules.epsilon:
            actions = random_actions(envs.spec.actions, explore, 1)
        out = envs.step(actions)
        game_over = bool(out["episode_end"][0])
        cut = not game_over and out["episode_step"][0] >= rules.max_episode_steps
        if game_over or cut:
            returns.append(float(out["episode_return"][0]))
            lengths.append(int(out["episode_step"][0]))
            log.info(
                "Episode %d: return %.1f in %d steps%s.",
                len(returns),
                returns[-1],
                lengths[-1],
                " (cut at test.max_episode_steps)" if cut else "",
            )
            if cut:
                envs.restart(0)
    return returns, lengths


def link_trained_run(out_dir: Path, trained_dir: Path) -> None:
    """out_dir/trained_run -> trained_dir (absolute), unless they are one dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() == trained_dir:
        return
    link = out_dir / TRAINED_RUN_LINK
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(trained_dir, target_is_directory=True)


def headless_rendering() -> None:
    """Lets pygame (gymnasium's classic-control renderers) draw frames without a display or a
    session: SDL's dummy video driver, its dummy audio driver (pygame-ce, which minigrid brings,
    opens audio and ALSA prints errors without a sound card), and a private XDG_RUNTIME_DIR where
    none is set (else SDL prints an error line though nothing is wrong)."""
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    if not os.environ.get("XDG_RUNTIME_DIR"):
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="torchbeast-xdg-")  # mode 0700, as SDL wants


def _log_to_wandb(cfg, trained_dir: Path, out_dir: Path, result: dict, videos: list) -> None:
    """Adds the evaluation to the trained run's wandb run; wandb's files go to out_dir/wandb.

    The trained run's id (kept in its dir) is copied to out_dir, so that its dir is never written.
    """
    id_file = trained_dir / RUN_ID_FILE
    if id_file.exists() and out_dir.resolve() != trained_dir:
        (out_dir / RUN_ID_FILE).write_text(id_file.read_text())
    # No config, name or tags: they stay the training run's.
    sink = WandbLog(cfg.logger.wandb, out_dir, job_type=None)
    figures = {f"eval/{key}": result[key] for key in EVAL_FIGURES}
    video = {"eval/video": max(videos, key=lambda path: path.stat().st_mtime)} if videos else {}
    sink.log(dict(step=result["step"], **figures), videos=video, summary=figures)
    sink.close()


def _record_video(env: gym.Env, folder: Path, num_episodes: int) -> gym.Env:
    """A video per game played; not of the game the env starts (a reset) after the last one."""
    try:
        import moviepy  # noqa: F401  (RecordVideo needs it)
    except ImportError:
        raise ConfigError(
            "test.record_video=true needs moviepy: pip install -e '.[video]' (or pip install moviepy)."
        ) from None
    return gym.wrappers.RecordVideo(
        env,
        str(folder),
        episode_trigger=lambda episode: episode < num_episodes,
        name_prefix="test",
        disable_logger=True,
    )


def _append_row(path: Path, row: dict) -> None:
    """Appends row to the csv; a file written with other columns is rewritten with all of them
    (metrics.CsvLog, as logs.csv: the old rows keep their values)."""
    log = CsvLog(path, resume_step=None, fields=list(row))
    log.write(row)
    log.close()
