"""How stale the data a batch learns from is, and how far apart its behaviour and learner policies are.

Policy lag (Sample Factory's version_diff): each step's rollout row carries `policy_version`, the
learner updates the acting weights reflected when they chose its action (layout.py); the learner's
update count minus it is how many updates old the behaviour policy was. backend.max_policy_lag
drops rollouts whose oldest step is older than a limit (and backend.synchronous, everything but
lag 0): they are masked out of the update and counted.

The divergence figures (KL(behaviour || learner), the share of importance ratios V-trace's rho_bar
clips, PPO's clip fraction) are per optimiser step, averaged over an update's steps as the loss
terms are: with optim.epochs or minibatches > 1 they include the learner's own drift within the
update, as PPO's clip fraction does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A rollout with no real steps (all padding) is never stale: it has nothing to learn from anyway.
NO_STEPS = torch.iinfo(torch.int64).max


@dataclass
class BehaviourVersions:
    """What the lag figures need from a batch's CPU copy (so that reading them never waits for a GPU)."""

    oldest: torch.Tensor  # [B]: each rollout's oldest policy_version over its real steps (NO_STEPS if none)
    total: int  # the sum of policy_version over the batch's real steps
    steps: int  # the batch's real steps

    @classmethod
    def of(cls, batch: dict) -> BehaviourVersions:
        """From a batch [T+1, B, ...]: rows 1..T hold the actions learned from (learner.py)."""
        versions, mask = batch["policy_version"][1:], batch["mask"][1:]
        oldest = versions.masked_fill(~mask, NO_STEPS).amin(dim=0)
        return cls(oldest, int(versions[mask].sum()), int(mask.sum()))


def lag_figures(versions: BehaviourVersions, learner_updates: int) -> dict:
    """policy_lag_mean and policy_lag_max over the batch's real steps, in learner updates; blank
    cells when it has none."""
    if not versions.steps:
        return dict(policy_lag_mean="", policy_lag_max="")
    return dict(
        policy_lag_mean=round(learner_updates - versions.total / versions.steps, 3),
        policy_lag_max=learner_updates - int(versions.oldest.min()),
    )


def stale_rollouts(versions: BehaviourVersions, learner_updates: int, max_lag: int | None) -> torch.Tensor:
    """The columns (rollouts) of which a step is more than max_lag updates old; none when max_lag is None."""
    if max_lag is None:
        return torch.zeros(0, dtype=torch.int64)
    oldest = versions.oldest
    return torch.nonzero((oldest != NO_STEPS) & (oldest < learner_updates - max_lag)).flatten()


def without_rollouts(batch: dict, columns: torch.Tensor) -> dict:
    """The batch with these columns masked out (a copy of the mask: the batch may share it with a
    buffer); its shape stays, so that minibatches, an LSTM's state and other ranks need no change."""
    mask = batch["mask"].clone()
    mask[:, columns.to(mask.device)] = False
    return {**batch, "mask": mask}


def divergence(inputs) -> dict:
    """The behaviour and learner policies apart, over a step's real steps (a LossInputs, learner.py):
    policy_kl = KL(behaviour || learner), rho_clip_fraction = the share of importance ratios above
    vtrace.clip_rho_threshold, and with vtrace.ppo_clip ppo_clip_fraction = the share of the
    surrogate's ratios (against vtrace.ppo_anchor) outside [1 - clip, 1 + clip]. Tensors (no host sync), detached."""
    with torch.no_grad():
        mask = inputs.mask > 0
        count = mask.sum().clamp(min=1)

        def share(flags: torch.Tensor) -> torch.Tensor:
            return (flags & mask).sum() / count

        kl = inputs.dist.kl(inputs.steps["policy_logits"], inputs.outputs["policy_logits"].float())
        figures = {"policy_kl": torch.where(mask, kl, torch.zeros_like(kl)).sum() / count}
        log_rhos = inputs.log_probs - inputs.behaviour_log_probs
        rho_bar = inputs.cfg.clip_rho_threshold
        if rho_bar is not None:
            figures["rho_clip_fraction"] = share(log_rhos > math.log(rho_bar))
        clip = inputs.cfg.ppo_clip
        if clip is not None:  # the surrogate's ratios, against its anchor (vtrace.ppo_anchor)
            ratios = torch.exp(inputs.log_probs - inputs.anchor_log_probs)
            figures["ppo_clip_fraction"] = share((ratios - 1).abs() > clip)
        return figures
