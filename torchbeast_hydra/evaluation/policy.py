"""A trained policy in your own Python code: load it from a run dir, make its env, act.

    from torchbeast_hydra.evaluation.policy import load_policy
    policy = load_policy("outputs/2026-11-25/10-00-00")     # a run dir (its checkpoint.pt)
    returns = policy.play(episodes=5)                        # whole games, as mode=test plays them

    envs = policy.make_envs(num_envs=4, seed=0)              # or step it yourself:
    out, state = envs.initial(), policy.initial_state(4)
    actions, state = policy.act(out, state)                  # [4, ...] numpy actions for envs.step
    out = envs.step(actions)

The env is the trained run's (its id, preprocessing and observation leaves); the model is the one
it trained, whatever this package's defaults say now.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from torchbeast_hydra.agent.models import make_model, saved_model_config
from torchbeast_hydra.env.settings import AtariEnvConfig
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.evaluation.evaluate import Rules, play
from torchbeast_hydra.run import checkpoint
from torchbeast_hydra.run.seeding import eval_seed


@dataclass
class Policy:
    model: torch.nn.Module  # agent.models.ActorCritic, in eval mode, on the CPU
    env_cfg: AtariEnvConfig  # the trained run's env (Atari settings are ignored by other ids)
    step: int  # the agent steps it was trained for

    def make_envs(self, num_envs: int = 1, seed: int = 0) -> Environments:
        return Environments(self.env_cfg, num_envs, seed=seed)

    def initial_state(self, num_envs: int = 1) -> tuple:
        """The core's state (an LSTM's; empty without one) at the start of every env's episode."""
        return self.model.initial_state(num_envs)

    @torch.no_grad()
    def act(self, env_outputs: dict, core_state: tuple, greedy: bool = True) -> tuple[np.ndarray, tuple]:
        """The actions for Environments' outputs (arrays [num_envs, ...]), and the core's next state."""
        inputs = {key: torch.from_numpy(np.asarray(array)).unsqueeze(0) for key, array in env_outputs.items()}
        outputs, core_state = self.model(inputs, core_state, action="greedy" if greedy else "sample")
        return outputs["action"][0].numpy(), core_state

    def play(
        self,
        episodes: int = 10,
        greedy: bool = True,
        seed: int = 0,
        max_episode_steps: int = Rules.max_episode_steps,
        epsilon: float = 0.0,
    ) -> list:
        """The returns of whole games (all lives), played as mode=test plays them: on an env seeded
        as mode=test's with this seed (seeding.eval_seed), never one a training run's actors played;
        epsilon as test.epsilon."""
        envs = self.make_envs(1, eval_seed(seed))
        try:
            returns, _ = play(self.model, envs, Rules(episodes, max_episode_steps, greedy, epsilon), eval_seed(seed))
        finally:
            envs.close()
        return returns


def load_policy(run_dir: str | Path) -> Policy:
    """The policy a run dir's checkpoint holds (raises checkpoint.CheckpointError naming what is wrong)."""
    state = checkpoint.load(checkpoint.path_in(run_dir))
    env_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AtariEnvConfig), state["config"]["env"]))
    model_cfg = saved_model_config(state["config"]["model"])
    envs = Environments(env_cfg, 1, seed=0)  # the spec: shapes, leaves and the action space
    try:
        model = make_model(model_cfg, envs.spec, initialise=False)
    finally:
        envs.close()
    model.load_state_dict(state["learner"]["model"])
    return Policy(model.eval(), env_cfg, state["step"])
