"""The run's own settings (mode=test's protocol, evaluation, data-parallel ranks) and the config as
plain data for checkpoints and trackers."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from torchbeast_hydra.errors import require


@dataclass
class TestConfig:
    """mode=test: how a trained run's checkpoint is played."""

    num_episodes: int = 10  # games played; the mean return is reported
    greedy: bool = True  # argmax actions; false samples from the policy
    record_video: bool = False  # videos/ in the run dir
    # Agent steps before a game is cut: ALE's own cap, 108,000 frames at frame skip 4.
    max_episode_steps: int = 27_000
    # Sticky actions while testing; null: as trained. 0.25 is the Machado et al. (2018) protocol.
    sticky_action_prob: Optional[float] = None
    # Greedy play only: a uniformly random action with this probability (epsilon-greedy, as DQN's
    # evaluations: 0.05; Rainbow's: 0.001). An argmax policy on a deterministic emulator can play a
    # rally that never ends (Pong: docs/results.md); a rare random action ends it. Also evaluation's.
    epsilon: float = 0.0


class EvalObjective(enum.Enum):
    """What a run returns to a sweeper (hydra/sweeper=optuna optimises it)."""

    final = "final"  # the final evaluation's mean return (the training mean when there is none)
    best = "best"  # the best evaluation's mean return over the run
    train = "train"  # the mean return of the last 100 training episodes


@dataclass
class EvalConfig:
    """Evaluation during training (run/periodic_eval.py): the current weights play whole episodes on
    envs of their own (own seeds, test mode's protocol: test.max_episode_steps and
    test.sticky_action_prob), in a process of their own, while the learner goes on. Rows go to
    eval.csv and, as eval/*, to wandb and TensorBoard."""

    interval_steps: int = 0  # every this many agent steps; 0: none during training
    episodes: int = 10  # whole episodes per evaluation
    greedy: bool = True  # argmax actions; false samples from the policy
    # With evaluation on (interval_steps > 0): one more at the end of a run that reaches total_steps,
    # in the learner process. Off with evaluation off: a greedy NetHack policy plays 5,000-step games.
    final: bool = True
    objective: EvalObjective = EvalObjective.final
    # Training ends, complete as at total_steps, once an evaluation's mean return reaches this (a
    # target met: the rest of the budget is not spent). null: train to total_steps.
    stop_at_return: Optional[float] = None
    # ... and the next this many evaluations (each started as soon as the one before ends) reach it
    # too: one lucky evaluation of a policy still learning does not end the run. 0: the first.
    stop_confirmations: int = 1


class DistBackend(enum.Enum):
    """torch.distributed's backend for the ranks' collectives."""

    auto = "auto"  # nccl when each rank on a machine has a GPU of its own, else gloo
    gloo = "gloo"  # CPU tensors (and what the ranks agree on each update, on any device)
    nccl = "nccl"  # GPU tensors: one GPU per rank (NCCL refuses two ranks on one GPU)


@dataclass
class DistributedConfig:
    """Data-parallel learners on torch.distributed (run/distributed.py, docs/distributed.md).

    torchrun and SLURM (submitit) say how many ranks there are; `nproc` is for one machine without
    them. A run with one rank runs none of this."""

    nproc: int = 1  # ranks this command starts on this machine itself (as Lightning's devices=N); 1: no spawning
    backend: DistBackend = DistBackend.auto
    # A rank that neither answers nor reaches the next update within this many seconds (dead, hung,
    # or still starting) stops the others, with a line naming it. Cover the slowest start of a rank.
    timeout_s: float = 300.0


def to_plain_dict(cfg) -> dict:
    """The resolved config as plain data for checkpoints and trackers, with secrets masked."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if plain.get("backend", {}).get("token"):
        plain["backend"]["token"] = "***"
    return plain


def check(cfg) -> None:
    """The run's top-level sizes and the test slice's checks."""
    require(cfg.total_steps > 0, f"total_steps={cfg.total_steps} must be positive.")
    require(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be at least 1.")
    require(cfg.unroll_length >= 1, f"unroll_length={cfg.unroll_length} must be at least 1.")
    require(cfg.checkpoint_interval_s > 0, "checkpoint_interval_s must be positive.")
    require(
        cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
        f"device={cfg.device!r}: use auto, cpu, cuda or cuda:N.",
    )
    require(cfg.eval.interval_steps >= 0, "eval.interval_steps must be >= 0 (0: no evaluation during training).")
    require(cfg.eval.episodes >= 1, "eval.episodes must be at least 1.")
    require(
        cfg.eval.stop_at_return is None or cfg.eval.interval_steps > 0,
        f"eval.stop_at_return={cfg.eval.stop_at_return} stops at an evaluation's return: set eval.interval_steps "
        "(e.g. eval.interval_steps=100000) or leave it null.",
    )
    require(cfg.eval.stop_confirmations >= 0, "eval.stop_confirmations must be >= 0 (0: stop at the first evaluation).")
    require(cfg.distributed.nproc >= 1, f"distributed.nproc={cfg.distributed.nproc} must be at least 1.")
    require(cfg.distributed.timeout_s > 0, "distributed.timeout_s must be positive.")
    test = cfg.test
    require(test.max_episode_steps >= 1, "test.max_episode_steps must be at least 1.")
    require(test.num_episodes >= 1, "test.num_episodes must be at least 1.")
    require(0 <= test.epsilon <= 1, f"test.epsilon={test.epsilon} must be in [0, 1] (0: argmax actions only).")
    sticky = test.sticky_action_prob
    require(
        sticky is None or 0 <= sticky <= 1, f"test.sticky_action_prob={sticky} must be in [0, 1] (or null: as trained)."
    )
