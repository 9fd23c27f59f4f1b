"""The learning math, shared by every backend: V-trace targets, IMPALA losses, one optimiser step.

A batch is a dict of tensors [T+1, B, ...] on the learner's device. Row 0 repeats the last row of
the previous unroll. Row t+1 holds the env's response (frame, reward, done) to the action taken
at row t, together with that action and the behaviour policy's logits; so the learning math uses
rows 1..T of the batch against the learner's outputs for rows 0..T-1, and the learner's value at
row T bootstraps the return. `mask` (rows 1..T) marks real steps; partial rollouts are padded.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import vtrace
from .config import OnNonFinite, OptimConfig, OptimName, RewardClipping, VtraceConfig

log = logging.getLogger(__name__)


def compute_losses(cfg: VtraceConfig, batch: dict, outputs: dict) -> dict:
    """IMPALA's losses, summed over time and batch as in TorchBeast.

    batch: the rollouts [T+1, B, ...]; outputs: the learner's forward pass over them.
    Returns total_loss (to differentiate) and its parts.
    """
    bootstrap_value = outputs["baseline"][-1]
    steps = {key: value[1:] for key, value in batch.items()}
    outputs = {key: value[:-1] for key, value in outputs.items()}
    mask = steps["mask"].float()

    rewards = steps["reward"]
    if RewardClipping(cfg.reward_clipping) is RewardClipping.abs_one:
        rewards = rewards.clamp(-1, 1)
    discounts = (~steps["done"]).float() * cfg.discounting

    behavior_log_probs = vtrace.action_log_probs(steps["policy_logits"], steps["action"])
    target_log_probs = vtrace.action_log_probs(outputs["policy_logits"], steps["action"])
    # A zero importance weight on padding zeroes its TD errors, so nothing flows back from it
    # into the targets of real steps (the last real value still bootstraps them).
    log_rhos = (target_log_probs - behavior_log_probs).masked_fill(mask == 0, -math.inf)
    targets = vtrace.from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=outputs["baseline"],
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=cfg.clip_rho_threshold,
        clip_pg_rho_threshold=cfg.clip_pg_rho_threshold,
    )
    pg_loss = policy_gradient_loss(outputs["policy_logits"], steps["action"], targets.pg_advantages, mask)
    baseline_loss = cfg.baseline_cost * 0.5 * (((targets.vs - outputs["baseline"]) ** 2) * mask).sum()
    entropy_loss = cfg.entropy_cost * negative_entropy(outputs["policy_logits"], mask)
    return dict(
        total_loss=pg_loss + baseline_loss + entropy_loss,
        pg_loss=pg_loss,
        baseline_loss=baseline_loss,
        entropy_loss=entropy_loss,
    )


def policy_gradient_loss(logits, actions, advantages, mask) -> torch.Tensor:
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), actions.flatten(), reduction="none")
    return (cross_entropy.view_as(advantages) * advantages.detach() * mask).sum()


def negative_entropy(logits, mask) -> torch.Tensor:
    log_policy = F.log_softmax(logits, dim=-1)
    return ((log_policy.exp() * log_policy).sum(-1) * mask).sum()


def make_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    if OptimName(cfg.name) is OptimName.rmsprop:
        return torch.optim.RMSprop(
            params, lr=cfg.learning_rate, alpha=cfg.alpha, eps=cfg.epsilon, momentum=cfg.momentum
        )
    return torch.optim.Adam(params, lr=cfg.learning_rate, betas=tuple(cfg.betas), eps=cfg.epsilon)


def make_scheduler(cfg: OptimConfig, optimizer, steps_done, total_steps: int):
    """Linear annealing to zero at total_steps (TorchBeast's schedule), or a constant rate.

    steps_done() returns the env steps learned from so far: counting steps rather than updates
    keeps the schedule right when partial rollouts make updates of different sizes.
    """
    if not cfg.anneal_lr:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: max(0.0, 1.0 - steps_done() / total_steps)
    )


class NonFiniteUpdate(RuntimeError):
    """A NaN/inf loss or gradient with optim.on_nonfinite=stop."""


class Learner:
    """The model being trained, its optimiser and LR schedule, and one update on a batch."""

    def __init__(self, cfg, model: nn.Module, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.optimizer = make_optimizer(cfg.optim, model.parameters())
        self.steps = 0  # env steps learned from (real steps: the mask's count)
        self.scheduler = make_scheduler(cfg.optim, self.optimizer, lambda: self.steps, cfg.total_steps)
        self.skipped_updates = 0

    def update(self, batch: dict, initial_core_state: tuple) -> dict:
        """One optimisation step; returns floats for logging. Non-finite updates are skipped."""
        self.steps += int(batch["mask"][1:].sum())
        self.model.train()
        outputs, _ = self.model(batch, initial_core_state, action="none")
        losses = compute_losses(self.cfg.vtrace, batch, outputs)
        self.optimizer.zero_grad(set_to_none=True)
        losses["total_loss"].backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_norm_clipping)
        stats = {key: value.item() for key, value in losses.items()}
        stats["grad_norm"] = grad_norm.item()
        if math.isfinite(stats["total_loss"]) and math.isfinite(stats["grad_norm"]):
            self.optimizer.step()
        elif OnNonFinite(self.cfg.optim.on_nonfinite) is OnNonFinite.stop:
            raise NonFiniteUpdate(
                f"non-finite loss or gradient ({stats}); the weights were not updated. Look for NaN/inf "
                "rewards or observations, or lower optim.learning_rate; optim.on_nonfinite=skip skips "
                "such updates instead.")
        else:
            self.skipped_updates += 1
            log.warning("Skipped an update with a non-finite loss or gradient: %s", stats)
        self.scheduler.step()
        stats["learning_rate"] = self.scheduler.get_last_lr()[0]
        return stats

    def state_dict(self) -> dict:
        return dict(
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            steps=self.steps,
        )

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
