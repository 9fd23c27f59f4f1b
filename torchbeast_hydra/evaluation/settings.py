"""evaluation's settings: mode=test's protocol (test), evaluation during training (eval) and what a
run returns to a sweeper."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

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
    """Evaluation during training (evaluation/periodic.py): the current weights play whole episodes on
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


def check(cfg) -> None:
    """The eval and test slices' checks."""
    require(cfg.eval.interval_steps >= 0, "eval.interval_steps must be >= 0 (0: no evaluation during training).")
    require(cfg.eval.episodes >= 1, "eval.episodes must be at least 1.")
    require(
        cfg.eval.stop_at_return is None or cfg.eval.interval_steps > 0,
        f"eval.stop_at_return={cfg.eval.stop_at_return} stops at an evaluation's return: set eval.interval_steps "
        "(e.g. eval.interval_steps=100000) or leave it null.",
    )
    require(cfg.eval.stop_confirmations >= 0, "eval.stop_confirmations must be >= 0 (0: stop at the first evaluation).")
    test = cfg.test
    require(test.max_episode_steps >= 1, "test.max_episode_steps must be at least 1.")
    require(test.num_episodes >= 1, "test.num_episodes must be at least 1.")
    require(0 <= test.epsilon <= 1, f"test.epsilon={test.epsilon} must be in [0, 1] (0: argmax actions only).")
    sticky = test.sticky_action_prob
    require(
        sticky is None or 0 <= sticky <= 1, f"test.sticky_action_prob={sticky} must be in [0, 1] (or null: as trained)."
    )
