"""V-trace against a slow reference written straight from the IMPALA paper (Espeholt et al. 2018).

Eq. 1 of the paper, with per-step discounts gamma_t = discounts[t]:

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i) (prod_{i=s}^{t-1} c_i) delta_t V
    delta_t V = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))
    rho_t = min(rho_bar, pi/mu),  c_i = lambda min(1, pi/mu)   (lambda = 1 in the paper's main results)

with V(x_T) = bootstrap_value, and the policy-gradient advantage

    A_s = rho^pg_s (r_s + gamma_s v_{s+1} - V(x_s)),  rho^pg_s = min(rho^pg_bar, pi/mu),  v_T = V(x_T).

The reference uses explicit loops and explicit products in float64; no backward recursion.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchbeast_hydra.learning import vtrace

THRESHOLDS = [1.0, 0.5, 2.0, None]  # None: no clipping


def clip(x: float, threshold) -> float:
    return x if threshold is None else min(threshold, x)


def reference_vtrace(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho, clip_pg_rho, trace_lambda=1.0):
    """Eq. 1 of the paper, one (s, t) term at a time. Arrays [T, B] (bootstrap [B]); float64 out."""
    log_rhos, discounts, rewards, values = (
        np.asarray(x, dtype=np.float64) for x in (log_rhos, discounts, rewards, values)
    )
    bootstrap_value = np.asarray(bootstrap_value, dtype=np.float64)
    T, B = values.shape
    vs = np.zeros((T, B))
    pg_advantages = np.zeros((T, B))
    for b in range(B):

        def V(t):  # V(x_t), with the bootstrap value after the last step
            return values[t, b] if t < T else bootstrap_value[b]

        def ratio(t):  # pi(a_t|x_t) / mu(a_t|x_t)
            return math.exp(log_rhos[t, b])

        for s in range(T):
            total = V(s)
            for t in range(s, T):
                discount_product = 1.0
                trace_product = 1.0
                for i in range(s, t):
                    discount_product *= discounts[i, b]
                    trace_product *= trace_lambda * min(1.0, ratio(i))
                rho_t = clip(ratio(t), clip_rho)
                delta_t = rho_t * (rewards[t, b] + discounts[t, b] * V(t + 1) - V(t))
                total += discount_product * trace_product * delta_t
            vs[s, b] = total
        for s in range(T):
            v_next = vs[s + 1, b] if s + 1 < T else bootstrap_value[b]
            rho_pg = clip(ratio(s), clip_pg_rho)
            pg_advantages[s, b] = rho_pg * (rewards[s, b] + discounts[s, b] * v_next - V(s))
    return vs, pg_advantages


def random_inputs(T: int, B: int, seed: int = 0):
    """float64 tensors [T, B]: spread-out log_rhos (ratios from ~0.05 to ~20) and episode ends."""
    g = torch.Generator().manual_seed(seed)
    log_rhos = 1.5 * torch.randn(T, B, generator=g, dtype=torch.float64)
    discounts = 0.8 + 0.19 * torch.rand(T, B, generator=g, dtype=torch.float64)  # varying gamma_t
    episode_end = torch.rand(T, B, generator=g, dtype=torch.float64) < 0.25
    if T > 1:
        episode_end[T // 2, :] = True  # at least one episode end inside every unroll
    discounts = discounts.masked_fill(episode_end, 0.0)
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    values = torch.randn(T, B, generator=g, dtype=torch.float64)
    bootstrap_value = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(log_rhos=log_rhos, discounts=discounts, rewards=rewards, values=values, bootstrap_value=bootstrap_value)


@pytest.mark.parametrize("clip_pg_rho", THRESHOLDS)
@pytest.mark.parametrize("clip_rho", THRESHOLDS)
@pytest.mark.parametrize("T", [1, 5, 20])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_from_importance_weights_matches_paper(B, T, clip_rho, clip_pg_rho):
    inputs = random_inputs(T, B, seed=100 * T + B)
    expected_vs, expected_adv = reference_vtrace(
        *(inputs[k].numpy() for k in ("log_rhos", "discounts", "rewards", "values", "bootstrap_value")),
        clip_rho,
        clip_pg_rho,
    )
    out = vtrace.from_importance_weights(**inputs, clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg_rho)
    np.testing.assert_allclose(out.vs.numpy(), expected_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.pg_advantages.numpy(), expected_adv, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("trace_lambda", [0.0, 0.5, 0.95])
def test_trace_lambda_matches_paper(trace_lambda):
    inputs = random_inputs(12, 4, seed=11)
    expected_vs, expected_adv = reference_vtrace(
        *(inputs[k].numpy() for k in ("log_rhos", "discounts", "rewards", "values", "bootstrap_value")),
        1.0,
        1.0,
        trace_lambda,
    )
    out = vtrace.from_importance_weights(**inputs, trace_lambda=trace_lambda)
    np.testing.assert_allclose(out.vs.numpy(), expected_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.pg_advantages.numpy(), expected_adv, rtol=1e-10, atol=1e-10)
    if trace_lambda == 0.0:  # no traces: one-step TD targets
        values_next = torch.cat([inputs["values"][1:], inputs["bootstrap_value"][None]])
        one_step = inputs["values"] + inputs["log_rhos"].exp().clamp(max=1.0) * (
            inputs["rewards"] + inputs["discounts"] * values_next - inputs["values"]
        )
        torch.testing.assert_close(out.vs, one_step)


def test_float32_inputs_match_reference():
    inputs = random_inputs(20, 8, seed=7)
    expected_vs, expected_adv = reference_vtrace(
        *(inputs[k].numpy() for k in ("log_rhos", "discounts", "rewards", "values", "bootstrap_value")),
        1.0,
        1.0,
    )
    out = vtrace.from_importance_weights(**{k: v.float() for k, v in inputs.items()})
    assert out.vs.dtype == torch.float32
    np.testing.assert_allclose(out.vs.numpy(), expected_vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.pg_advantages.numpy(), expected_adv, rtol=1e-4, atol=1e-4)


def test_test_inputs_make_clipping_matter():
    """Guards the parametrised test: with these inputs each threshold changes the result."""
    inputs = random_inputs(20, 8, seed=2008)
    ratios = inputs["log_rhos"].exp()
    assert (ratios > 2.0).any() and (ratios < 0.5).any()
    unclipped = vtrace.from_importance_weights(**inputs, clip_rho_threshold=None, clip_pg_rho_threshold=None)
    for threshold in (0.5, 1.0, 2.0):
        clipped_rho = vtrace.from_importance_weights(**inputs, clip_rho_threshold=threshold, clip_pg_rho_threshold=None)
        clipped_pg = vtrace.from_importance_weights(**inputs, clip_rho_threshold=None, clip_pg_rho_threshold=threshold)
        assert not torch.allclose(clipped_rho.vs, unclipped.vs)
        assert not torch.allclose(clipped_pg.pg_advantages, unclipped.pg_advantages)
        # clip_pg_rho_threshold only affects the advantages, not the targets.
        torch.testing.assert_close(clipped_pg.vs, unclipped.vs)


def test_default_thresholds_are_one():
    inputs = random_inputs(5, 3, seed=3)
    default = vtrace.from_importance_weights(**inputs)
    explicit = vtrace.from_importance_weights(**inputs, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0)
    torch.testing.assert_close(default.vs, explicit.vs)
    torch.testing.assert_close(default.pg_advantages, explicit.pg_advantages)


def test_episode_end_cuts_the_trace():
    """With discounts[t] = 0, v_s for s <= t does not depend on anything after step t."""
    inputs = random_inputs(6, 2, seed=11)
    inputs["discounts"][:] = 0.9
    inputs["discounts"][2, :] = 0.0
    base = vtrace.from_importance_weights(**inputs)
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["rewards"][3:] += 10.0
    changed["values"][3:] -= 5.0
    changed["bootstrap_value"] += 7.0
    out = vtrace.from_importance_weights(**changed)
    torch.testing.assert_close(out.vs[:3], base.vs[:3])
    torch.testing.assert_close(out.pg_advantages[:3], base.pg_advantages[:3])
    assert not torch.allclose(out.vs[3:], base.vs[3:])


@pytest.mark.parametrize("clip_rho, clip_pg_rho", [(1.0, 1.0), (0.5, 2.0), (None, None), (2.0, 0.5)])
@pytest.mark.parametrize("T, B", [(1, 1), (5, 3), (20, 8)])
def test_from_logits_matches_paper(T, B, clip_rho, clip_pg_rho):
    A = 5
    g = torch.Generator().manual_seed(T * 10 + B)
    inputs = random_inputs(T, B, seed=T + B)
    del inputs["log_rhos"]
    behavior_logits = 2.0 * torch.randn(T, B, A, generator=g, dtype=torch.float64)
    target_logits = 2.0 * torch.randn(T, B, A, generator=g, dtype=torch.float64)
    actions = torch.randint(A, (T, B), generator=g)

    out = vtrace.from_logits(
        behavior_policy_logits=behavior_logits,
        target_policy_logits=target_logits,
        actions=actions,
        clip_rho_threshold=clip_rho,
        clip_pg_rho_threshold=clip_pg_rho,
        **inputs,
    )

    # log pi(a|x) = z_a - log sum_j exp(z_j), written out element by element.
    def log_prob(logits, t, b):
        z = logits[t, b].tolist()
        return z[actions[t, b]] - math.log(sum(math.exp(zj) for zj in z))

    expected_target = np.array([[log_prob(target_logits, t, b) for b in range(B)] for t in range(T)])
    expected_behavior = np.array([[log_prob(behavior_logits, t, b) for b in range(B)] for t in range(T)])
    expected_log_rhos = expected_target - expected_behavior
    np.testing.assert_allclose(out.target_action_log_probs.numpy(), expected_target, rtol=1e-10)
    np.testing.assert_allclose(out.behavior_action_log_probs.numpy(), expected_behavior, rtol=1e-10)
    np.testing.assert_allclose(out.log_rhos.numpy(), expected_log_rhos, rtol=1e-10, atol=1e-12)

    expected_vs, expected_adv = reference_vtrace(
        expected_log_rhos,
        inputs["discounts"].numpy(),
        inputs["rewards"].numpy(),
        inputs["values"].numpy(),
        inputs["bootstrap_value"].numpy(),
        clip_rho,
        clip_pg_rho,
    )
    np.testing.assert_allclose(out.vs.numpy(), expected_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.pg_advantages.numpy(), expected_adv, rtol=1e-10, atol=1e-10)


def test_log_rhos_equal_log_softmax_difference():
    T, B, A = 4, 3, 6
    g = torch.Generator().manual_seed(5)
    behavior_logits = torch.randn(T, B, A, generator=g)
    target_logits = torch.randn(T, B, A, generator=g)
    actions = torch.randint(A, (T, B), generator=g)
    inputs = {k: v.float() for k, v in random_inputs(T, B).items() if k != "log_rhos"}
    out = vtrace.from_logits(behavior_logits, target_logits, actions, **inputs)
    target_lp = torch.log_softmax(target_logits, -1)
    behavior_lp = torch.log_softmax(behavior_logits, -1)
    for t in range(T):
        for b in range(B):
            a = actions[t, b]
            expected = target_lp[t, b, a] - behavior_lp[t, b, a]
            torch.testing.assert_close(out.log_rhos[t, b], expected)


def test_from_logits_equal_policies_is_on_policy():
    T, B, A = 5, 2, 3
    logits = torch.randn(T, B, A, dtype=torch.float64)
    actions = torch.randint(A, (T, B))
    inputs = random_inputs(T, B, seed=9)
    del inputs["log_rhos"]
    out = vtrace.from_logits(logits, logits.clone(), actions, **inputs)
    torch.testing.assert_close(out.log_rhos, torch.zeros(T, B, dtype=torch.float64))
    on_policy = vtrace.from_importance_weights(log_rhos=torch.zeros(T, B, dtype=torch.float64), **inputs)
    torch.testing.assert_close(out.vs, on_policy.vs)


def test_time_major_shapes():
    T, B, A = 7, 3, 4
    inputs = random_inputs(T, B, seed=1)
    out = vtrace.from_importance_weights(**inputs)
    assert out.vs.shape == (T, B)
    assert out.pg_advantages.shape == (T, B)

    logits_out = vtrace.from_logits(
        torch.randn(T, B, A, dtype=torch.float64),
        torch.randn(T, B, A, dtype=torch.float64),
        torch.randint(A, (T, B)),
        **{k: v for k, v in inputs.items() if k != "log_rhos"},
    )
    for name in ("vs", "pg_advantages", "log_rhos", "behavior_action_log_probs", "target_action_log_probs"):
        assert getattr(logits_out, name).shape == (T, B), name


def test_time_is_dim_0_and_batch_is_dim_1():
    """A reward at (t, b) only moves vs[:t+1, b]; bootstrap_value[b] only moves column b."""
    T, B = 6, 3
    inputs = random_inputs(T, B, seed=4)
    inputs["discounts"][:] = 0.9  # no episode ends, so every earlier step sees the change
    inputs["log_rhos"][:] = 0.0
    base = vtrace.from_importance_weights(**inputs)

    bumped = {k: v.clone() for k, v in inputs.items()}
    bumped["rewards"][3, 1] += 1.0
    out = vtrace.from_importance_weights(**bumped)
    delta = out.vs - base.vs
    expected = torch.zeros(T, B, dtype=torch.float64)
    expected[:4, 1] = torch.tensor([0.9**3, 0.9**2, 0.9, 1.0], dtype=torch.float64)
    torch.testing.assert_close(delta, expected)

    bumped = {k: v.clone() for k, v in inputs.items()}
    bumped["bootstrap_value"][2] += 1.0
    out = vtrace.from_importance_weights(**bumped)
    delta = out.vs - base.vs
    expected = torch.zeros(T, B, dtype=torch.float64)
    expected[:, 2] = torch.tensor([0.9 ** (T - s) for s in range(T)], dtype=torch.float64)
    torch.testing.assert_close(delta, expected)


def test_from_importance_weights_builds_no_graph():
    inputs = {k: v.clone().requires_grad_(True) for k, v in random_inputs(5, 3).items()}
    out = vtrace.from_importance_weights(**inputs)
    assert not out.vs.requires_grad and out.vs.grad_fn is None
    assert not out.pg_advantages.requires_grad and out.pg_advantages.grad_fn is None


def test_from_logits_targets_are_constants_but_log_probs_are_not():
    T, B, A = 5, 3, 4
    behavior_logits = torch.randn(T, B, A, requires_grad=True)
    target_logits = torch.randn(T, B, A, requires_grad=True)
    values = torch.randn(T, B, requires_grad=True)
    inputs = {k: v.float() for k, v in random_inputs(T, B).items() if k not in ("log_rhos", "values")}
    out = vtrace.from_logits(behavior_logits, target_logits, torch.randint(A, (T, B)), values=values, **inputs)
    assert not out.vs.requires_grad
    assert not out.pg_advantages.requires_grad
    assert out.target_action_log_probs.requires_grad  # the policy gradient flows through these


def test_on_policy_vs_is_n_step_return_by_hand():
    """log_rhos = 0 and gamma = 0.9: vs is the bootstrapped discounted return, whatever V is."""
    rewards = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    values = torch.tensor([[0.5], [-4.0], [7.0]], dtype=torch.float64)
    bootstrap = torch.tensor([10.0], dtype=torch.float64)
    out = vtrace.from_importance_weights(
        log_rhos=torch.zeros(3, 1, dtype=torch.float64),
        discounts=torch.full((3, 1), 0.9, dtype=torch.float64),
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap,
    )
    # v_2 = 3 + 0.9 * 10                          = 12
    # v_1 = 2 + 0.9 * 3 + 0.81 * 10               = 12.8
    # v_0 = 1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 10   = 12.52
    torch.testing.assert_close(out.vs[:, 0], torch.tensor([12.52, 12.8, 12.0], dtype=torch.float64))
    # A_s = r_s + 0.9 v_{s+1} - V(x_s)
    expected_adv = [1 + 0.9 * 12.8 - 0.5, 2 + 0.9 * 12.0 + 4.0, 3 + 0.9 * 10 - 7.0]
    torch.testing.assert_close(out.pg_advantages[:, 0], torch.tensor(expected_adv, dtype=torch.float64))


@pytest.mark.parametrize("T, B", [(1, 1), (5, 3), (20, 8)])
def test_on_policy_vs_is_n_step_return(T, B):
    gamma = 0.95
    inputs = random_inputs(T, B, seed=T * B)
    inputs["log_rhos"] = torch.zeros(T, B, dtype=torch.float64)
    inputs["discounts"] = torch.full((T, B), gamma, dtype=torch.float64)
    out = vtrace.from_importance_weights(**inputs)
    rewards, bootstrap = inputs["rewards"], inputs["bootstrap_value"]
    for b in range(B):
        for s in range(T):
            n_step_return = sum(gamma ** (t - s) * rewards[t, b].item() for t in range(s, T))
            n_step_return += gamma ** (T - s) * bootstrap[b].item()
            assert out.vs[s, b].item() == pytest.approx(n_step_return, rel=1e-12, abs=1e-12)
