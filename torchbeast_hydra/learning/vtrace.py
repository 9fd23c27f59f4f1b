"""V-trace off-policy targets (Espeholt et al. 2018, section 4.1), with the reference API.

All tensors are time-major: [T, B]; bootstrap_value is [B]. The targets are computed backwards
with the recursion  vs_t - V(x_t) = delta_t + gamma_t * c_t * (vs_{t+1} - V(x_{t+1})),  where
delta_t = rho_t * (r_t + gamma_t * V(x_{t+1}) - V(x_t)), rho_t = min(rho_bar, pi/mu) and
c_t = lambda * min(1, pi/mu) (lambda = 1 in the paper's main results; below 1 it trades bias for
variance as GAE's lambda does).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class VTraceReturns(NamedTuple):
    vs: torch.Tensor
    pg_advantages: torch.Tensor


class VTraceFromLogitsReturns(NamedTuple):
    vs: torch.Tensor
    pg_advantages: torch.Tensor
    log_rhos: torch.Tensor
    behavior_action_log_probs: torch.Tensor
    target_action_log_probs: torch.Tensor


def action_log_probs(policy_logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log pi(a_t | x_t) for logits [T, B, A] and actions [T, B]."""
    log_probs = F.log_softmax(policy_logits, dim=-1)
    return log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def from_logits(
    behavior_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: Optional[float] = 1.0,
    clip_pg_rho_threshold: Optional[float] = 1.0,
) -> VTraceFromLogitsReturns:
    """V-trace for softmax policies given as logits."""
    target_action_log_probs = action_log_probs(target_policy_logits, actions)
    behavior_action_log_probs = action_log_probs(behavior_policy_logits, actions)
    log_rhos = target_action_log_probs - behavior_action_log_probs
    vtrace_returns = from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    return VTraceFromLogitsReturns(
        log_rhos=log_rhos,
        behavior_action_log_probs=behavior_action_log_probs,
        target_action_log_probs=target_action_log_probs,
        **vtrace_returns._asdict(),
    )


@torch.no_grad()
def from_importance_weights(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: Optional[float] = 1.0,
    clip_pg_rho_threshold: Optional[float] = 1.0,
    trace_lambda: float = 1.0,
) -> VTraceReturns:
    """V-trace targets vs and policy-gradient advantages from log importance weights."""
    rhos = torch.exp(log_rhos)
    clipped_rhos = rhos if clip_rho_threshold is None else rhos.clamp(max=clip_rho_threshold)
    cs = trace_lambda * rhos.clamp(max=1.0)
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)

    decay = discounts * cs
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_values = torch.empty_like(values)
    for t in range(values.shape[0] - 1, -1, -1):
        acc = deltas[t] + decay[t] * acc
        vs_minus_values[t] = acc
    vs = vs_minus_values + values

    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)])
    pg_rhos = rhos if clip_pg_rho_threshold is None else rhos.clamp(max=clip_pg_rho_threshold)
    pg_advantages = pg_rhos * (rewards + discounts * vs_t_plus_1 - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)
