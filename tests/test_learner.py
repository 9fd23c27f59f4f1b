"""IMPALA losses against numbers worked out by hand, the partial-rollout mask, and Learner.update."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from torchbeast_hydra.agent import models
from torchbeast_hydra.agent import settings as model_settings
from torchbeast_hydra.agent.settings import MLPConfig
from torchbeast_hydra.backends.mono.settings import MonoConfig
from torchbeast_hydra.config import Config
from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning import settings, vtrace
from torchbeast_hydra.learning.learner import (
    Learner,
    LossInputs,
    NonFiniteUpdate,
    baseline_term,
    compute_losses,
    loss_inputs,
    make_optimizer,
)
from torchbeast_hydra.learning.settings import RewardClipping, RMSPropConfig, VtraceConfig

GAMMA, BASELINE_COST, ENTROPY_COST = 0.9, 0.5, 0.01


def vtrace_cfg(reward_clipping=RewardClipping.none, **kwargs) -> VtraceConfig:
    return VtraceConfig(
        discounting=GAMMA,
        baseline_cost=BASELINE_COST,
        entropy_cost=ENTROPY_COST,
        reward_clipping=reward_clipping,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# A tiny batch, T=2 steps, B=1, 2 actions, and its losses worked out by hand.
#
# Row t+1 of the batch holds the action a_t, the behaviour logits and the reward r_t of step t;
# the learner's outputs row t are for step t, and its baseline at row T=2 is the bootstrap.
# ---------------------------------------------------------------------------------------------

LEARNER_LOGITS = [[0.5, -0.5], [0.2, 0.3], [1.0, 1.0]]  # rows 0, 1, 2 (row 2 is not a step)
BEHAVIOR_LOGITS = [[0.0, 0.0], [0.0, 0.0], [-1.0, 1.0]]  # rows 0, 1, 2 (row 0 is unused)
ACTIONS = [1, 0, 1]  # rows 0, 1, 2: a_0 = 0, a_1 = 1
VALUES = [0.3, -0.2, 0.6]  # V(x_0), V(x_1), bootstrap V(x_2)


def tiny_batch(rewards=(0.0, 2.0, -0.5), done=(False, False, False)) -> dict:
    """Batch rows 0..2 for B=1 (the reward and done of step t are in row t+1)."""

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype).unsqueeze(1)  # [T+1] -> [T+1, B=1]

    return dict(
        frame=torch.zeros(3, 1, 4),
        reward=col(list(rewards), torch.float32),
        done=col(list(done), torch.bool),
        episode_return=col([0.0, 0.0, 0.0], torch.float32),
        episode_step=col([0, 1, 2], torch.int32),
        last_action=col([0, 1, 0], torch.int64),
        episode_end=col(list(done), torch.bool),
        action=col(ACTIONS, torch.int64),
        policy_logits=torch.tensor(BEHAVIOR_LOGITS).unsqueeze(1),
        baseline=col([0.0, 0.0, 0.0], torch.float32),
        mask=col([True, True, True], torch.bool),
    )


def tiny_outputs() -> dict:
    return dict(
        policy_logits=torch.tensor(LEARNER_LOGITS, dtype=torch.float32).unsqueeze(1).requires_grad_(True),
        baseline=torch.tensor(VALUES, dtype=torch.float32).unsqueeze(1).requires_grad_(True),
    )


def softmax2(z):
    e0, e1 = math.exp(z[0]), math.exp(z[1])
    return [e0 / (e0 + e1), e1 / (e0 + e1)]


def by_hand(r0, r1, done1=False, done2=False, clip_rho=1.0, clip_pg_rho=1.0):
    """The T=2 losses and their gradients, from the paper's formulas with plain floats.

    r0, r1: the (already clipped) rewards of steps 0 and 1; done1/done2: done in rows 1/2.
    """
    g0 = 0.0 if done1 else GAMMA  # discount of step 0
    g1 = 0.0 if done2 else GAMMA  # discount of step 1
    V0, V1, V2 = VALUES
    a0, a1 = ACTIONS[1], ACTIONS[2]

    pi0, pi1 = softmax2(LEARNER_LOGITS[0]), softmax2(LEARNER_LOGITS[1])
    mu0, mu1 = softmax2(BEHAVIOR_LOGITS[1]), softmax2(BEHAVIOR_LOGITS[2])
    ratio0 = pi0[a0] / mu0[a0]  # 0.731 / 0.5 = 1.46: clipped at 1
    ratio1 = pi1[a1] / mu1[a1]  # 0.525 / 0.881 = 0.60: not clipped at 1
    clip = lambda x, c: x if c is None else min(c, x)  # noqa: E731
    rho0, rho1 = clip(ratio0, clip_rho), clip(ratio1, clip_rho)
    c0 = min(1.0, ratio0)

    delta0 = rho0 * (r0 + g0 * V1 - V0)
    delta1 = rho1 * (r1 + g1 * V2 - V1)
    vs1 = V1 + delta1
    vs0 = V0 + delta0 + g0 * c0 * delta1
    adv0 = clip(ratio0, clip_pg_rho) * (r0 + g0 * vs1 - V0)
    adv1 = clip(ratio1, clip_pg_rho) * (r1 + g1 * V2 - V1)

    pg_loss = -math.log(pi0[a0]) * adv0 - math.log(pi1[a1]) * adv1
    baseline_loss = BASELINE_COST * 0.5 * ((vs0 - V0) ** 2 + (vs1 - V1) ** 2)
    neg_entropy = [sum(p * math.log(p) for p in pi) for pi in (pi0, pi1)]
    entropy_loss = ENTROPY_COST * sum(neg_entropy)

    # d/dz_j of -log pi(a) is pi_j - [j == a]; of sum_k pi_k log pi_k is pi_j (log pi_j - sum_k pi_k log pi_k).
    def logits_grad(pi, a, adv, h):
        return [
            (pi[j] - (1.0 if j == a else 0.0)) * adv + ENTROPY_COST * pi[j] * (math.log(pi[j]) - h) for j in range(2)
        ]

    # vs is a constant target (computed without a graph): d/dV_t = -baseline_cost * (vs_t - V_t).
    return dict(
        pg_loss=pg_loss,
        baseline_loss=baseline_loss,
        entropy_loss=entropy_loss,
        total_loss=pg_loss + baseline_loss + entropy_loss,
        logits_grad=[
            logits_grad(pi0, a0, adv0, neg_entropy[0]),
            logits_grad(pi1, a1, adv1, neg_entropy[1]),
            [0.0, 0.0],
        ],
        baseline_grad=[-BASELINE_COST * (vs0 - V0), -BASELINE_COST * (vs1 - V1), 0.0],
    )


def assert_losses(losses: dict, expected: dict) -> None:
    for key in ("pg_loss", "baseline_loss", "entropy_loss", "total_loss"):
        assert losses[key].item() == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key


def test_hand_example_exercises_clipping():
    """The example is only useful if step 0's ratio is clipped and step 1's is not."""
    pi0, pi1 = softmax2(LEARNER_LOGITS[0]), softmax2(LEARNER_LOGITS[1])
    mu0, mu1 = softmax2(BEHAVIOR_LOGITS[1]), softmax2(BEHAVIOR_LOGITS[2])
    assert pi0[ACTIONS[1]] / mu0[ACTIONS[1]] > 1.0
    assert pi1[ACTIONS[2]] / mu1[ACTIONS[2]] < 1.0


@pytest.mark.parametrize("done1, done2", [(False, False), (True, False), (False, True)])
def test_losses_by_hand(done1, done2):
    batch = tiny_batch(rewards=(0.0, 0.7, -0.5), done=(False, done1, done2))
    losses = compute_losses(vtrace_cfg(), batch, tiny_outputs())
    assert_losses(losses, by_hand(0.7, -0.5, done1=done1, done2=done2))


def test_losses_by_hand_with_numbers_written_out():
    """Step by step for the default example (no done, rewards 0.7 and -0.5), to 4 decimals."""
    losses = compute_losses(vtrace_cfg(), tiny_batch(rewards=(0.0, 0.7, -0.5)), tiny_outputs())
    # pi0 = [0.7311, 0.2689], pi1 = [0.4750, 0.5250]; mu0(a0=0) = 0.5, mu1(a1=1) = 0.8808
    # rho0 = c0 = min(1, 1.4621) = 1; rho1 = c1 = 0.5250 / 0.8808 = 0.5961
    # delta1 = 0.5961 * (-0.5 + 0.9 * 0.6 + 0.2) = 0.5961 * 0.24 = 0.14306
    # delta0 = 1 * (0.7 + 0.9 * -0.2 - 0.3) = 0.22
    # vs1 = -0.2 + 0.14306 = -0.05694;  vs0 = 0.3 + 0.22 + 0.9 * 0.14306 = 0.64875
    # adv0 = 1 * (0.7 + 0.9 * -0.05694 - 0.3) = 0.34875;  adv1 = delta1 = 0.14306
    # pg = -log(0.7311) * 0.34875 - log(0.5250) * 0.14306 = 0.10924 + 0.09218 = 0.20142
    # baseline = 0.5 * 0.5 * (0.34875^2 + 0.14306^2) = 0.03553
    # entropy = 0.01 * ((0.7311 log 0.7311 + 0.2689 log 0.2689) + (0.4750 log 0.4750 + 0.5250 log 0.5250))
    #         = 0.01 * (-0.58220 - 0.69190) = -0.012741
    assert losses["pg_loss"].item() == pytest.approx(0.20142, abs=1e-4)
    assert losses["baseline_loss"].item() == pytest.approx(0.03553, abs=1e-4)
    assert losses["entropy_loss"].item() == pytest.approx(-0.012741, abs=1e-5)
    assert losses["total_loss"].item() == pytest.approx(0.20142 + 0.03553 - 0.012741, abs=2e-4)


@pytest.mark.parametrize("clip_rho, clip_pg_rho", [(None, None), (0.5, 2.0), (2.0, 0.5)])
def test_losses_by_hand_with_other_thresholds(clip_rho, clip_pg_rho):
    cfg = vtrace_cfg(clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg_rho)
    losses = compute_losses(cfg, tiny_batch(rewards=(0.0, 0.7, -0.5)), tiny_outputs())
    assert_losses(losses, by_hand(0.7, -0.5, clip_rho=clip_rho, clip_pg_rho=clip_pg_rho))


def test_reward_clipping_abs_one_vs_none():
    batch = tiny_batch(rewards=(0.0, 5.0, -3.0))
    clipped = compute_losses(vtrace_cfg(RewardClipping.abs_one), batch, tiny_outputs())
    unclipped = compute_losses(vtrace_cfg(RewardClipping.none), batch, tiny_outputs())
    assert_losses(clipped, by_hand(1.0, -1.0))
    assert_losses(unclipped, by_hand(5.0, -3.0))
    assert clipped["total_loss"].item() != pytest.approx(unclipped["total_loss"].item())
    # Rewards inside [-1, 1] are left alone by abs_one.
    small = tiny_batch(rewards=(0.0, 0.7, -0.5))
    assert_losses(compute_losses(vtrace_cfg(RewardClipping.abs_one), small, tiny_outputs()), by_hand(0.7, -0.5))


def test_reward_clipping_from_omegaconf_config():
    """The config as Hydra hands it over (an OmegaConf node, the enum given as a string)."""
    cfg = OmegaConf.structured(vtrace_cfg())
    cfg.reward_clipping = "abs_one"
    losses = compute_losses(cfg, tiny_batch(rewards=(0.0, 5.0, -3.0)), tiny_outputs())
    assert_losses(losses, by_hand(1.0, -1.0))


@pytest.mark.parametrize("done2", [False, True])
def test_gradients_by_hand(done2):
    outputs = tiny_outputs()
    losses = compute_losses(vtrace_cfg(), tiny_batch(rewards=(0.0, 0.7, -0.5), done=(False, False, done2)), outputs)
    losses["total_loss"].backward()
    expected = by_hand(0.7, -0.5, done2=done2)
    np.testing.assert_allclose(outputs["policy_logits"].grad[:, 0].numpy(), expected["logits_grad"], atol=1e-6)
    np.testing.assert_allclose(outputs["baseline"].grad[:, 0].numpy(), expected["baseline_grad"], atol=1e-6)


def test_gradient_of_each_part():
    """pg loss only moves the logits, baseline loss only the baseline."""
    outputs = tiny_outputs()
    losses = compute_losses(vtrace_cfg(), tiny_batch(rewards=(0.0, 0.7, -0.5)), outputs)
    logits_grad, baseline_grad = torch.autograd.grad(
        losses["baseline_loss"], [outputs["policy_logits"], outputs["baseline"]], allow_unused=True
    )
    assert logits_grad is None or torch.all(logits_grad == 0)
    np.testing.assert_allclose(baseline_grad[:, 0].numpy(), by_hand(0.7, -0.5)["baseline_grad"], atol=1e-6)

    outputs = tiny_outputs()
    losses = compute_losses(vtrace_cfg(), tiny_batch(rewards=(0.0, 0.7, -0.5)), outputs)
    logits_grad, baseline_grad = torch.autograd.grad(
        losses["pg_loss"], [outputs["policy_logits"], outputs["baseline"]], allow_unused=True
    )
    assert baseline_grad is None or torch.all(baseline_grad == 0)
    assert logits_grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Partial rollouts: padded steps (mask False) must not change anything.
# ---------------------------------------------------------------------------------------------


def random_rollout(T: int, B: int, A: int, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    batch = dict(
        frame=torch.randn(T + 1, B, 4, generator=g),
        reward=3.0 * torch.randn(T + 1, B, generator=g),
        done=torch.rand(T + 1, B, generator=g) < 0.2,
        episode_return=torch.randn(T + 1, B, generator=g),
        episode_step=torch.randint(100, (T + 1, B), generator=g, dtype=torch.int32),
        last_action=torch.randint(A, (T + 1, B), generator=g),
        episode_end=torch.rand(T + 1, B, generator=g) < 0.2,
        action=torch.randint(A, (T + 1, B), generator=g),
        policy_logits=2.0 * torch.randn(T + 1, B, A, generator=g),
        baseline=torch.randn(T + 1, B, generator=g),
        mask=torch.ones(T + 1, B, dtype=torch.bool),
    )
    outputs = dict(
        policy_logits=2.0 * torch.randn(T + 1, B, A, generator=g),
        baseline=torch.randn(T + 1, B, generator=g),
    )
    return batch, outputs


def losses_and_grads(cfg, batch, outputs):
    outputs = {k: v.detach().clone().requires_grad_(True) for k, v in outputs.items()}
    losses = compute_losses(cfg, batch, outputs)
    losses["total_loss"].backward()
    return (
        {k: v.item() for k, v in losses.items()},
        outputs["policy_logits"].grad,
        outputs["baseline"].grad,
    )


@pytest.mark.parametrize("clip_rho, clip_pg_rho", [(1.0, 1.0), (None, None), (2.0, 0.5)])
@pytest.mark.parametrize("real_steps", [1, 3, 5])
def test_padded_rollout_equals_shorter_rollout(real_steps, clip_rho, clip_pg_rho):
    T, A = 6, 3
    cfg = vtrace_cfg(RewardClipping.abs_one, clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg_rho)
    batch, outputs = random_rollout(T, 1, A, seed=real_steps)
    padded = dict(batch)
    padded["mask"] = batch["mask"].clone()
    padded["mask"][real_steps + 1 :] = False  # rows 1..real_steps are real steps
    # The short rollout: rows 0..real_steps; the learner's value at row real_steps bootstraps it.
    short_batch = {k: v[: real_steps + 1] for k, v in batch.items()}
    short_outputs = {k: v[: real_steps + 1] for k, v in outputs.items()}

    padded_losses, padded_logits_grad, padded_baseline_grad = losses_and_grads(cfg, padded, outputs)
    short_losses, short_logits_grad, short_baseline_grad = losses_and_grads(cfg, short_batch, short_outputs)

    assert padded_losses == pytest.approx(short_losses, rel=1e-6, abs=1e-6)
    torch.testing.assert_close(padded_logits_grad[: real_steps + 1], short_logits_grad)
    torch.testing.assert_close(padded_baseline_grad[: real_steps + 1], short_baseline_grad)
    # Padding (and the row after the last step) gets exactly zero gradient.
    assert torch.all(padded_logits_grad[real_steps:] == 0)
    assert torch.all(padded_baseline_grad[real_steps:] == 0)
    # ... and without the mask the padding would have counted.
    unmasked_losses, _, _ = losses_and_grads(cfg, batch, outputs)
    assert unmasked_losses["total_loss"] != pytest.approx(short_losses["total_loss"], rel=1e-6)


def test_padding_in_one_column_of_a_batch():
    """B=2: column 0 complete (4 steps), column 1 padded after 2 steps; losses add up per column."""
    T, A = 4, 2
    cfg = vtrace_cfg(RewardClipping.none)
    batch, outputs = random_rollout(T, 2, A, seed=42)
    batch["mask"][3:, 1] = False

    both_losses, both_logits_grad, both_baseline_grad = losses_and_grads(cfg, batch, outputs)
    full_losses, full_logits_grad, full_baseline_grad = losses_and_grads(
        cfg, {k: v[:, :1] for k, v in batch.items()}, {k: v[:, :1] for k, v in outputs.items()}
    )
    short_losses, short_logits_grad, short_baseline_grad = losses_and_grads(
        cfg, {k: v[:3, 1:] for k, v in batch.items()}, {k: v[:3, 1:] for k, v in outputs.items()}
    )
    for key in both_losses:
        assert both_losses[key] == pytest.approx(full_losses[key] + short_losses[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(both_logits_grad[:, :1], full_logits_grad)
    torch.testing.assert_close(both_baseline_grad[:, :1], full_baseline_grad)
    torch.testing.assert_close(both_logits_grad[:3, 1:], short_logits_grad)
    torch.testing.assert_close(both_baseline_grad[:3, 1:], short_baseline_grad)
    assert torch.all(both_logits_grad[2:, 1] == 0)
    assert torch.all(both_baseline_grad[2:, 1] == 0)


# ---------------------------------------------------------------------------------------------
# Learner: one optimiser step on a tiny MLP.
# ---------------------------------------------------------------------------------------------

SPEC = EnvSpec.box((4,), np.dtype("float32"), 2)


def learner_cfg(batch_size=2, unroll_length=3, total_steps=24, anneal_lr=True, use_lstm=False):
    cfg = OmegaConf.structured(Config)
    cfg.env = OmegaConf.structured(EnvConfig)
    cfg.model = OmegaConf.structured(MLPConfig(use_lstm=use_lstm, hidden_sizes=[8]))
    cfg.vtrace = OmegaConf.structured(VtraceConfig)
    cfg.optim = OmegaConf.structured(RMSPropConfig(learning_rate=0.01, anneal_lr=anneal_lr))
    cfg.backend = OmegaConf.structured(MonoConfig)
    cfg.batch_size = batch_size
    cfg.unroll_length = unroll_length
    cfg.total_steps = total_steps
    return cfg


def make_learner(cfg, **ranks) -> Learner:
    """ranks: Learner's data-parallel hooks (average_gradients, sum_over_ranks)."""
    torch.manual_seed(0)
    model = models.make_model(cfg.model, SPEC)
    return Learner(cfg, model, torch.device("cpu"), **ranks)


def learner_batch(cfg, seed=0) -> dict:
    batch, _ = random_rollout(cfg.unroll_length, cfg.batch_size, SPEC.actions.nvec[0], seed)
    return batch


def params_of(learner) -> list:
    return [p.detach().clone() for p in learner.model.parameters()]


@pytest.mark.parametrize("use_lstm", [False, True])
def test_update_changes_parameters(use_lstm):
    cfg = learner_cfg(use_lstm=use_lstm)
    learner = make_learner(cfg)
    before = params_of(learner)
    stats = learner.update(learner_batch(cfg), learner.model.initial_state(cfg.batch_size))
    after = params_of(learner)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(b, a) for b, a in zip(before, after))
    for key in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss", "grad_norm", "learning_rate"):
        assert isinstance(stats[key], float) and math.isfinite(stats[key]), key
    assert stats["total_loss"] == pytest.approx(stats["pg_loss"] + stats["baseline_loss"] + stats["entropy_loss"])
    assert learner.skipped_updates == 0


def test_update_reports_the_losses_of_the_model_outputs():
    cfg = learner_cfg()
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    with torch.no_grad():
        outputs, _ = copy.deepcopy(learner.model)(batch, ())
        expected = compute_losses(cfg.vtrace, batch, outputs)
    stats = learner.update(batch, ())
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value.item(), rel=1e-5), key
    # The policy's entropy a step, though entropy_cost weighs it: near log(A) for a fresh, near-uniform head.
    per_step = -expected["entropy_loss"].item() / cfg.vtrace.entropy_cost / batch["mask"][1:].sum().item()
    assert stats["policy_entropy"] == pytest.approx(per_step)
    assert stats["policy_entropy"] == pytest.approx(math.log(SPEC.actions.nvec[0]), rel=1e-3)
    cfg.vtrace.entropy_cost = 0.0  # no cost: no entropy loss, the entropy still logged
    stats = make_learner(cfg).update(batch, ())
    assert stats["entropy_loss"] == 0.0
    assert stats["policy_entropy"] == pytest.approx(math.log(SPEC.actions.nvec[0]), rel=1e-3)


def test_learning_rate_anneals_linearly_to_zero():
    cfg = learner_cfg(batch_size=2, unroll_length=3, total_steps=24)  # 6 steps/update: 4 updates
    learner = make_learner(cfg)
    lr0 = cfg.optim.learning_rate
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(lr0)
    for k in range(1, 7):
        stats = learner.update(learner_batch(cfg, seed=k), ())
        expected = lr0 * max(0.0, 1.0 - k / 4)
        assert stats["learning_rate"] == pytest.approx(expected)
        assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    # At lr 0 the parameters stay put.
    before = params_of(learner)
    learner.update(learner_batch(cfg, seed=99), ())
    assert all(torch.equal(b, a) for b, a in zip(before, params_of(learner)))


def test_learning_rate_schedule_counts_real_steps_of_partial_rollouts():
    cfg = learner_cfg(batch_size=2, unroll_length=3, total_steps=24)
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    batch["mask"][2:, 0] = False  # first rollout: 1 real step of 3; second: 3 of 3
    stats = learner.update(batch, ())
    assert learner.steps == 4
    assert stats["learning_rate"] == pytest.approx(cfg.optim.learning_rate * (1 - 4 / 24))


def test_learning_rate_constant_without_annealing():
    cfg = learner_cfg(anneal_lr=False)
    learner = make_learner(cfg)
    for k in range(6):
        stats = learner.update(learner_batch(cfg, seed=k), ())
        assert stats["learning_rate"] == pytest.approx(cfg.optim.learning_rate)


# A skipped first update steps the LR scheduler before the optimiser has ever stepped.
SCHEDULER_WARNING = "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`"


def assert_same_state(state: dict, expected: dict) -> None:
    """Optimiser state ({param index: {name: tensor or number}}) unchanged, value by value."""
    assert state.keys() == expected.keys()
    for index, slots in state.items():
        assert slots.keys() == expected[index].keys()
        for name, value in slots.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected[index][name])), (index, name)


def assert_non_finite_batch_is_skipped(learner, cfg, batch) -> None:
    before = params_of(learner)
    optimizer_state_before = copy.deepcopy(learner.optimizer.state_dict()["state"])
    stats = learner.update(batch, ())
    assert math.isnan(stats["total_loss"])
    assert learner.skipped_updates == 1
    assert all(torch.equal(b, a) for b, a in zip(before, params_of(learner)))
    assert_same_state(learner.optimizer.state_dict()["state"], optimizer_state_before)  # rmsprop stats untouched

    # The next finite batch trains normally.
    stats = learner.update(learner_batch(cfg, seed=1), ())
    assert math.isfinite(stats["total_loss"])
    assert learner.skipped_updates == 1
    after = params_of(learner)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(b, a) for b, a in zip(before, after))


@pytest.mark.filterwarnings(SCHEDULER_WARNING)
def test_nan_reward_skips_the_update():
    cfg = learner_cfg()
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    batch["reward"][2, 1] = float("nan")
    assert_non_finite_batch_is_skipped(learner, cfg, batch)


@pytest.mark.filterwarnings(SCHEDULER_WARNING)
def test_nan_behaviour_logits_skip_the_update():
    """A NaN that reaches the losses but not the model's forward pass (the behaviour logits)."""
    cfg = learner_cfg()
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    batch["policy_logits"][2, 1, 0] = float("nan")
    assert_non_finite_batch_is_skipped(learner, cfg, batch)


def test_non_finite_update_stops_when_asked_and_leaves_the_weights():
    cfg = learner_cfg()
    cfg.optim.on_nonfinite = "stop"
    learner = make_learner(cfg)
    before = params_of(learner)
    batch = learner_batch(cfg)
    batch["reward"][1, 0] = float("nan")
    with pytest.raises(NonFiniteUpdate, match="optim.on_nonfinite=skip"):
        learner.update(batch, ())
    assert all(torch.equal(b, a) for b, a in zip(before, params_of(learner)))


# ---------------------------------------------------------------------------------------------
# Loss terms: a dict of named terms, each times its cost, summed into total_loss.
# ---------------------------------------------------------------------------------------------


def l2_on_logits(inputs):  # an extra term, as a user would write it (vtrace.extra_losses)
    return (inputs.outputs["policy_logits"] ** 2 * inputs.mask.unsqueeze(-1)).sum()


def test_extra_loss_term_is_added_with_its_cost_and_reported_by_name():
    plain = compute_losses(vtrace_cfg(), tiny_batch(), tiny_outputs())
    cfg = vtrace_cfg(extra_losses={"l2_loss": dict(fn=f"{__name__}.l2_on_logits", cost=0.5)})
    losses = compute_losses(cfg, tiny_batch(), tiny_outputs())
    expected_l2 = 0.5 * sum(x * x for row in LEARNER_LOGITS[:2] for x in row)
    assert losses["l2_loss"].item() == pytest.approx(expected_l2)
    for name in ("pg_loss", "baseline_loss", "entropy_loss"):
        assert losses[name].item() == pytest.approx(plain[name].item())
    assert losses["total_loss"].item() == pytest.approx(plain["total_loss"].item() + expected_l2)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"l2_loss": dict(fn="no_such_module.fn", cost=1.0)}, "not an importable function"),
        ({"pg_loss": dict(fn=f"{__name__}.l2_on_logits", cost=1.0)}, "name extra terms"),
        ({"l2": dict(fn=f"{__name__}.l2_on_logits", cost=1.0)}, "name extra terms"),
    ],
)
def test_bad_extra_loss_terms_are_refused_clearly(extra, message):
    with pytest.raises(ConfigError, match=message):
        compute_losses(vtrace_cfg(extra_losses=extra), tiny_batch(), tiny_outputs())


@pytest.mark.parametrize(
    "initial_square_avg, first_step",
    [(1.0, 0.01 / (math.sqrt(0.99 + 0.01) + 0.01)), (0.0, 0.01 / (math.sqrt(0.01) + 0.01))],
)
def test_rmsprop_first_update_follows_the_initial_square_avg(initial_square_avg, first_step):
    # Starting at 1 (TensorFlow's, IMPALA's): the first update is about the learning rate. At 0
    # (torch's): about 10x, the burst that killed AtariNet's ReLUs on Pong (docs/defaults.md).
    param = torch.nn.Parameter(torch.zeros(3))
    cfg = RMSPropConfig(learning_rate=0.01, epsilon=0.01, alpha=0.99, initial_square_avg=initial_square_avg)
    optimizer = make_optimizer(cfg, [param])
    param.grad = torch.ones(3)
    optimizer.step()
    assert param.detach() == pytest.approx([-first_step] * 3, rel=1e-5)


def test_rmsprop_initial_state_survives_a_checkpoint_round_trip():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = make_optimizer(RMSPropConfig(momentum=0.9), [param])
    restored = make_optimizer(RMSPropConfig(momentum=0.9, initial_square_avg=0.0), [param])
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert torch.equal(restored.state[param]["square_avg"], torch.ones(2))
    param.grad = torch.ones(2)
    restored.step()  # the momentum buffer made up front is used as is
    assert torch.isfinite(param).all()


def test_resume_with_changed_hyperparameters_uses_them_and_rederives_the_schedule():
    """A checkpoint's optimiser state carries over; the config's learning rate, epsilon and
    total_steps apply, the LR schedule re-derived from them (resume.py lists the changes)."""
    cfg = learner_cfg(batch_size=2, unroll_length=3, total_steps=24)
    learner = make_learner(cfg)
    for k in range(2):  # 12 of 24 steps
        learner.update(learner_batch(cfg, seed=k), ())
    state = copy.deepcopy(learner.state_dict())

    changed = learner_cfg(batch_size=2, unroll_length=3, total_steps=48)
    changed.optim.learning_rate, changed.optim.epsilon = 0.001, 0.5
    resumed = make_learner(changed)
    resumed.load_state_dict(state)
    group = resumed.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.001 * (1 - 12 / 48)) and group["eps"] == 0.5
    assert_same_state(resumed.optimizer.state_dict()["state"], state["optimizer"]["state"])
    stats = resumed.update(learner_batch(changed, seed=5), ())
    assert stats["learning_rate"] == pytest.approx(0.001 * (1 - 18 / 48))

    same = make_learner(cfg)  # and an unchanged config resumes exactly where it was
    same.load_state_dict(state)
    assert same.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * (1 - 12 / 24))


# ---------------------------------------------------------------------------------------------
# Sample reuse (optim.epochs, optim.minibatches) and PPO's clipped surrogate (vtrace.ppo_clip).
# ---------------------------------------------------------------------------------------------


def log_softmax_taken(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def test_clipped_surrogate_by_hand():
    """pg_loss = -sum min(r A, clip(r, 0.8, 1.2) A), r = pi/mu, A = r_t + gamma vs_{t+1} - V(x_t)."""
    T, B, A = 5, 3, 3
    cfg = vtrace_cfg(ppo_clip=0.2)
    batch, outputs = random_rollout(T, B, A, seed=3)
    losses = compute_losses(cfg, batch, outputs)

    steps = {k: v[1:] for k, v in batch.items()}
    ratio = torch.exp(
        log_softmax_taken(outputs["policy_logits"][:-1], steps["action"])
        - log_softmax_taken(steps["policy_logits"], steps["action"])
    )
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()  # both cases
    discounts = GAMMA * (~steps["done"]).float()
    log_rhos = torch.log(ratio)
    values = outputs["baseline"]
    targets = vtrace.from_importance_weights(log_rhos, discounts, steps["reward"], values[:-1], values[-1])
    vs_next = torch.cat([targets.vs[1:], outputs["baseline"][-1:]])
    advantages = steps["reward"] + discounts * vs_next - outputs["baseline"][:-1]
    expected = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum()
    assert losses["pg_loss"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_clipped_surrogate_on_policy_has_impalas_gradient_and_none_beyond_the_clip():
    T, B, A = 5, 3, 3
    batch, outputs = random_rollout(T, B, A, seed=4)
    batch["policy_logits"][1:] = outputs["policy_logits"][:-1]  # on-policy: r = 1 everywhere
    _, impala_grad, _ = losses_and_grads(vtrace_cfg(), batch, outputs)
    _, ppo_grad, _ = losses_and_grads(vtrace_cfg(ppo_clip=0.2), batch, outputs)
    torch.testing.assert_close(ppo_grad, impala_grad)

    # Far off-policy (r > 1.2 with A > 0, or r < 0.8 with A < 0): those steps' gradient is clipped to 0.
    batch["policy_logits"][1:] = 3.0 * torch.randn(T, B, A, generator=torch.Generator().manual_seed(5))
    cfg = vtrace_cfg(ppo_clip=0.2)
    outputs_grad = {k: v.detach().clone().requires_grad_(True) for k, v in outputs.items()}
    compute_losses(cfg, batch, outputs_grad)["pg_loss"].backward()
    steps = {k: v[1:] for k, v in batch.items()}
    ratio = torch.exp(
        log_softmax_taken(outputs["policy_logits"][:-1], steps["action"])
        - log_softmax_taken(steps["policy_logits"], steps["action"])
    )
    advantages = loss_inputs(cfg, batch, outputs).advantages
    clipped = ((ratio > 1.2) & (advantages > 0)) | ((ratio < 0.8) & (advantages < 0))
    assert clipped.any() and (~clipped).any()
    step_grads = outputs_grad["policy_logits"].grad[:-1].abs().sum(-1)
    assert torch.all(step_grads[clipped] == 0)
    assert torch.all(step_grads[~clipped] > 0)


def test_normalized_advantages_have_zero_mean_unit_std_over_real_steps():
    batch, outputs = random_rollout(6, 4, 3, seed=6)
    batch["mask"][4:, 1] = False
    inputs = loss_inputs(vtrace_cfg(normalize_advantages=True), batch, outputs)
    real = inputs.mask > 0
    assert inputs.advantages[real].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert inputs.advantages[real].std(unbiased=False).item() == pytest.approx(1.0, rel=1e-4)
    assert torch.all(inputs.advantages[~real] == 0)
    raw = loss_inputs(vtrace_cfg(), batch, outputs).targets.pg_advantages
    torch.testing.assert_close(inputs.targets.pg_advantages, raw)  # the targets themselves untouched


def test_epochs_and_minibatches_take_that_many_steps_and_count_each_sample_once():
    cfg = learner_cfg(batch_size=4, unroll_length=3, total_steps=1000)
    cfg.model.normalize_obs = True
    cfg.optim.epochs, cfg.optim.minibatches = 3, 2
    learner = make_learner(cfg)
    norm = learner.model.body.normalize
    seen_columns = []
    original = learner._unroll_inputs
    learner._unroll_inputs = lambda part, state, scale: (
        seen_columns.append(part["frame"][0, :, 0].tolist()) or original(part, state, scale)
    )
    batch = learner_batch(cfg)
    stats = learner.update(batch, ())
    assert len(seen_columns) == 6  # 3 epochs x 2 minibatches
    assert learner.optimizer.state_dict()["state"][0]["step"].item() == 6
    first_column = batch["frame"][0, :, 0].tolist()
    for epoch in range(3):  # each epoch: every column once, in two halves of whole unrolls
        halves = seen_columns[2 * epoch : 2 * epoch + 2]
        assert [len(h) for h in halves] == [2, 2]
        assert sorted(halves[0] + halves[1]) == sorted(first_column)
    assert norm.count.item() == 4 * 4  # the learner's forward sees rows 0..T of 4 columns, once
    assert learner.steps == 12  # the LR schedule counts the batch once, not per pass
    assert stats["learning_rate"] == pytest.approx(cfg.optim.learning_rate * (1 - 12 / 1000))


def test_minibatches_are_as_many_as_configured_when_they_do_not_divide_the_batch():
    cfg = learner_cfg(batch_size=5, total_steps=1000)
    cfg.optim.minibatches = 4
    learner = make_learner(cfg)
    sizes = []
    original = learner._unroll_inputs
    learner._unroll_inputs = lambda part, state, scale: (
        sizes.append(part["done"].shape[1]) or original(part, state, scale)
    )
    learner.update(learner_batch(cfg), ())
    assert sorted(sizes) == [1, 1, 1, 2]  # four optimiser steps, every column once
    assert learner.optimizer.state_dict()["state"][0]["step"].item() == 4


def test_minibatches_must_fit_the_batch():
    cfg = learner_cfg(batch_size=4)
    cfg.optim.minibatches = 5
    with pytest.raises(ConfigError, match="optim.minibatches=5 must be between 1 and batch_size=4"):
        settings.check(cfg)
    cfg.optim.minibatches, cfg.optim.epochs = 2, 0
    with pytest.raises(ConfigError, match="optim.epochs must be at least 1"):
        settings.check(cfg)


def test_separate_critic_keeps_the_value_loss_out_of_the_policys_body():
    cfg = learner_cfg()
    cfg.model.separate_critic = True
    learner = make_learner(cfg)
    model = learner.model
    assert model.critic_body is not None and model.critic_body is not model.body
    batch = learner_batch(cfg)
    outputs, _ = model(batch, (), action="none")
    losses = compute_losses(cfg.vtrace, batch, outputs)
    losses["baseline_loss"].backward(retain_graph=True)
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.body.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.critic_body.parameters())
    model.zero_grad(set_to_none=True)
    (losses["pg_loss"] + losses["entropy_loss"]).backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.critic_body.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.body.parameters())


def test_channels_last_learns_what_the_contiguous_layout_learns():
    """accel.channels_last (the default) lays the conv weights out channels-last and changes
    nothing but rounding: two updates give the contiguous layout's losses and weights."""
    from test_gpu_ready import fixed_batch

    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env

    from helpers import compose_config

    results = []
    for layout in ("true", "false"):
        # float32 both ways: left at auto, a CPU with bf16 math would round both to bf16's precision
        overrides = ["env=pong", "model=atari_net", f"accel.channels_last={layout}", "accel.bf16_autocast=false"]
        cfg = compose_config(overrides)
        cfg.batch_size, cfg.unroll_length = 4, 10
        spec = probe_env(cfg.env)
        torch.manual_seed(0)
        learner = Learner(cfg, make_model(cfg.model, spec), torch.device("cpu"))
        batch = fixed_batch(cfg, spec)
        stats = [learner.update(batch, learner.model.initial_state(cfg.batch_size)) for _ in range(2)]
        convs = [p for p in learner.model.parameters() if p.dim() == 4]
        results.append((stats, convs))
    (fast, fast_convs), (plain, plain_convs) = results
    assert fast_convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in fast_convs)
    assert not any(p.is_contiguous(memory_format=torch.channels_last) for p in plain_convs)
    for step_fast, step_plain in zip(fast, plain):
        for key in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss"):
            assert step_fast[key] == pytest.approx(step_plain[key], rel=1e-4, abs=1e-5), key
    for a, b in zip(fast_convs, plain_convs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# PopArt (model.normalize_values): value targets' statistics, outputs preserved, losses in their scale.
# ---------------------------------------------------------------------------------------------


def test_value_norm_tracks_the_targets_and_preserves_the_heads_outputs():
    torch.manual_seed(0)
    norm, head = models.ValueNorm(beta=0.1), torch.nn.Linear(5, 1)
    features = torch.randn(7, 5)
    assert (norm.mean.item(), norm.std.item()) == (0.0, 1.0)  # before any update: the head's own outputs
    before = norm.denormalize(head(features))
    norm.update(torch.tensor(50.0), torch.tensor(50.0**2 + 20.0**2), head)
    mean, std = norm.mean, norm.std
    assert (mean.item(), std.item()) == pytest.approx((50.0, 20.0))  # the first update, bias-corrected: its own
    torch.testing.assert_close(norm.denormalize(head(features)), before)  # Preserving Outputs Precisely
    norm.update(torch.tensor(150.0), torch.tensor(150.0**2), head)
    weights = (0.9 * 0.1, 0.1)  # the EMA's weights of the two updates, before the correction 1 - 0.9**2
    expected_mean = (weights[0] * 50 + weights[1] * 150) / 0.19
    assert norm.mean.item() == pytest.approx(expected_mean)
    torch.testing.assert_close(norm.denormalize(head(features)), before)


def popart_cfg(**kwargs):
    cfg = learner_cfg(**kwargs)
    cfg.model.normalize_values = True
    cfg.vtrace.reward_clipping = "none"
    return cfg


def big_reward_batch(cfg, scale: float) -> dict:
    batch = learner_batch(cfg)
    batch["reward"] = batch["reward"].abs() * scale + scale
    return batch


def test_normalized_values_learn_from_the_targets_moments_in_their_scale():
    cfg = popart_cfg()
    learner = make_learner(cfg)
    batch = big_reward_batch(cfg, 1000.0)
    with torch.no_grad():  # what the update's forward pass sees: the model before its step
        inputs = loss_inputs(cfg.vtrace, batch, copy.deepcopy(learner.model)(batch, ())[0])
    vs, mask = inputs.targets.vs, inputs.mask
    stats = learner.update(batch, ())
    mean, std = learner.model.value_norm.mean, learner.model.value_norm.std
    assert mean.item() == pytest.approx((vs * mask).sum().item() / mask.sum().item(), rel=1e-5)
    assert std.item() > 100  # the targets' spread, in the thousands
    # The first step's value loss was still in the targets' own units (scale 1); the next is in units of std.
    second = learner.update(batch, ())
    assert second["baseline_loss"] < stats["baseline_loss"] / 1000
    plain_cfg = learner_cfg()
    plain_cfg.vtrace.reward_clipping = "none"
    plain = make_learner(plain_cfg)
    plain.update(batch, ())
    assert plain.update(batch, ())["baseline_loss"] > 1000 * second["baseline_loss"]


def test_normalized_values_update_once_per_sample_and_survive_a_checkpoint():
    cfg = popart_cfg(batch_size=4, unroll_length=3, total_steps=1000)
    cfg.optim.epochs, cfg.optim.minibatches = 3, 2
    learner = make_learner(cfg)
    learner.update(big_reward_batch(cfg, 10.0), ())
    assert learner.model.value_norm.updates.item() == 2  # the first pass's two minibatches, not the reuse
    restored = make_learner(cfg)
    restored.load_state_dict(copy.deepcopy(learner.state_dict()))
    for a, b in zip(learner.model.value_norm.buffers(), restored.model.value_norm.buffers()):
        assert torch.equal(a, b)
    batch = learner_batch(cfg)
    with torch.no_grad():
        torch.testing.assert_close(restored.model(batch, ())[0]["baseline"], learner.model(batch, ())[0]["baseline"])


def test_value_norm_beta_must_be_a_rate():
    cfg = popart_cfg()
    cfg.model.value_norm_beta = 0.0
    with pytest.raises(ConfigError, match=r"model.value_norm_beta=0.0 must be in \(0, 1\]"):
        model_settings.check(cfg)


# ---------------------------------------------------------------------------------------------
# optim.minibatch_unit=steps: PPO's minibatches of single steps.
# ---------------------------------------------------------------------------------------------


def steps_cfg(epochs=1, minibatches=1, **kwargs):
    cfg = learner_cfg(batch_size=4, unroll_length=5, total_steps=1000, **kwargs)
    cfg.optim.epochs, cfg.optim.minibatches, cfg.optim.minibatch_unit = epochs, minibatches, "steps"
    return cfg


@pytest.mark.parametrize("ppo", [False, True])
def test_one_minibatch_of_steps_learns_what_one_of_whole_unrolls_does(ppo):
    """The same targets (one forward pass over the batch) and the same steps: the same losses and step."""
    results = []
    for unit in ("unrolls", "steps"):
        cfg = steps_cfg()
        cfg.optim.minibatch_unit = unit
        cfg.vtrace.ppo_clip, cfg.vtrace.normalize_advantages = (0.2, True) if ppo else (None, False)
        learner = make_learner(cfg)
        batch = learner_batch(cfg)
        batch["mask"][4:, 1] = False  # a partial rollout: its padding is no step of either
        results.append((learner.update(batch, ()), params_of(learner)))
    (by_unrolls, unroll_params), (by_steps, step_params) = results
    for key in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss", "grad_norm"):
        assert by_steps[key] == pytest.approx(by_unrolls[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(unroll_params, step_params):
        torch.testing.assert_close(a, b)


def record_minibatches_of_steps(learner) -> list:
    """The flat step indices of each minibatch the learner takes, appended as it takes them."""
    seen = []
    original = learner._steps_inputs
    learner._steps_inputs = lambda b, whole, steps, scale: (
        seen.append(steps.tolist()) or original(b, whole, steps, scale)
    )
    return seen


def test_minibatches_of_steps_cover_each_real_step_once_per_pass():
    cfg = steps_cfg(epochs=2, minibatches=3)
    cfg.model.normalize_obs = True
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    batch["mask"][3:, 2] = False  # column 2: two real steps, then padding
    batch["frame"][..., 0] = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)  # each input row's own id
    seen = record_minibatches_of_steps(learner)
    learner.update(batch, ())
    assert len(seen) == 6 and learner.optimizer.state_dict()["state"][0]["step"].item() == 6
    real = sorted(t * 4 + b for t in range(5) for b in range(4) if not (b == 2 and t >= 2))
    for epoch in range(2):  # each pass: every real step once, in three minibatches of about a third
        taken = [step for part in seen[3 * epoch : 3 * epoch + 3] for step in part]
        assert sorted(taken) == real and [len(part) for part in seen[3 * epoch : 3 * epoch + 3]] == [6, 6, 5]
    assert seen[0] != sorted(seen[0]) or seen[1] != sorted(seen[1])  # drawn at random, not in order
    assert learner.model.body.normalize.count.item() == len(real)  # the first pass's steps, once each


def test_a_batch_of_fewer_real_steps_than_minibatches_still_takes_that_many_steps():
    """With several ranks each optimiser step is a collective: every batch must take optim.minibatches."""
    cfg = steps_cfg(minibatches=8)
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    batch["mask"][:] = False
    batch["mask"][1:4, 0] = True  # three real steps, the rest padding
    seen = record_minibatches_of_steps(learner)
    learner.update(batch, ())
    assert len(seen) == 8 and learner.optimizer.state_dict()["state"][0]["step"].item() == 8
    assert sorted({step for part in seen for step in part}) == [0, 4, 8]  # each real step, none of the padding


def test_minibatches_of_steps_need_a_feed_forward_model_and_fit_the_batch():
    cfg = steps_cfg(minibatches=21)
    with pytest.raises(ConfigError, match="optim.minibatches=21 must be between 1 and the batch's 20 steps"):
        settings.check(cfg)
    cfg = steps_cfg(minibatches=20, use_lstm=True)
    with pytest.raises(ConfigError, match="optim.minibatch_unit=steps needs a feed-forward model"):
        settings.check(cfg)


@pytest.mark.parametrize("targets_once", [False, True])
def test_targets_once_keeps_the_first_passs_targets_for_every_pass(targets_once):
    """PPO's GAE once per rollout: with optim.targets_once the later passes learn towards the targets
    the batch's first pass computed; without it each pass computes its own from the weights then."""
    cfg = steps_cfg(epochs=3, minibatches=2)
    cfg.optim.targets_once = targets_once
    learner = make_learner(cfg)
    passes = []
    original = learner._batch_targets
    learner._batch_targets = lambda *args: passes.append(original(*args)) or passes[-1]
    seen = []
    steps_inputs = learner._steps_inputs
    learner._steps_inputs = lambda b, whole, steps, scale: seen.append(whole) or steps_inputs(b, whole, steps, scale)
    learner.update(learner_batch(cfg), ())
    assert len(passes) == (1 if targets_once else 3) and len(seen) == 6
    assert all(whole is passes[0] for whole in seen) == targets_once
    if not targets_once:  # the weights moved between passes: so did the targets
        assert not torch.equal(passes[0].targets.vs, passes[2].targets.vs)


def test_targets_once_needs_minibatches_of_steps():
    cfg = steps_cfg(minibatches=2)
    cfg.optim.minibatch_unit, cfg.optim.targets_once = "unrolls", True
    with pytest.raises(ConfigError, match="optim.targets_once=true needs optim.minibatch_unit=steps"):
        settings.check(cfg)


def test_normalized_rewards_are_divided_by_the_return_std_and_clipped():
    batch = tiny_batch(rewards=(0.0, 2.0, -50.0))
    cfg = vtrace_cfg(normalize_rewards=True, reward_norm_clip=3.0, reward_scale=0.5)
    inputs = loss_inputs(cfg, batch, tiny_outputs(), return_std=4.0)
    # after reward_scale: 1.0 and -25.0; divided by 4: 0.25 and -6.25, clipped to -3
    torch.testing.assert_close(inputs.rewards.flatten(), torch.tensor([0.25, -3.0]))
    plain = loss_inputs(vtrace_cfg(reward_scale=0.5), batch, tiny_outputs(), return_std=4.0)
    torch.testing.assert_close(plain.rewards.flatten(), torch.tensor([1.0, -25.0]))  # off: return_std unused


def test_return_statistics_follow_the_targets_count_each_sample_once_and_survive_a_checkpoint():
    cfg = learner_cfg(batch_size=4, unroll_length=5, total_steps=1000)
    cfg.vtrace.normalize_rewards, cfg.vtrace.reward_clipping = True, "none"
    cfg.optim.epochs, cfg.optim.minibatches = 3, 2
    learner = make_learner(cfg)
    assert learner.return_std() == pytest.approx(1.0)  # before any batch: rewards as they are
    batch = learner_batch(cfg)
    batch["reward"] *= 100.0  # returns of a few hundred: their spread is far from 1
    stats = learner.update(batch, ())
    assert learner.return_norm.count.item() == 4 * 5  # the batch's real steps, once over three epochs
    std = float(learner.return_std())
    assert std > 10 and stats["return_std"] == pytest.approx(std)
    # The next batch's rewards are divided by it.
    inputs = learner._unroll_inputs(batch, (), 1.0)
    torch.testing.assert_close(inputs.rewards, (batch["reward"][1:] / std).clamp(-10, 10))
    # A resumed learner divides by the same figure.
    resumed = make_learner(cfg)
    resumed.load_state_dict(copy.deepcopy(learner.state_dict()))
    assert float(resumed.return_std()) == pytest.approx(std)
    assert "return_norm" not in make_learner(learner_cfg()).state_dict()  # off: checkpoints as before


def test_clipped_value_loss_takes_the_larger_error_of_the_value_and_the_clipped_one():
    batch, outputs = tiny_batch(), tiny_outputs()
    # The behaviour's values of x_0, x_1 (rows 1, 2), on the far side of the learner's from the targets
    # (1.95, -0.06): moved at most 0.1 towards the learner's, they are further from the targets.
    batch["baseline"] = torch.tensor([0.0, -1.0, 0.25]).unsqueeze(1)
    plain = loss_inputs(vtrace_cfg(), batch, outputs)
    clipped = loss_inputs(vtrace_cfg(value_clip=0.1), batch, outputs)
    vs, values = plain.targets.vs.flatten().detach(), torch.tensor(VALUES[:2])
    behaviour = torch.tensor([-1.0, 0.25])
    moved = behaviour + (values - behaviour).clamp(-0.1, 0.1)
    expected = 0.5 * torch.maximum((vs - values) ** 2, (vs - moved) ** 2).sum()
    got = baseline_term(clipped)
    torch.testing.assert_close(got, expected)
    assert got.item() > baseline_term(plain).item()


def anchored_update(anchor: str) -> tuple[dict, LossInputs]:
    """One pass, one minibatch of steps, PPO's clips, behaviour logits and values far from the
    learner's: the update's figures and the LossInputs its one optimiser step learned from."""
    cfg = steps_cfg()
    cfg.vtrace.ppo_clip, cfg.vtrace.value_clip, cfg.vtrace.ppo_anchor = 0.2, 0.1, anchor
    learner = make_learner(cfg)
    batch = learner_batch(cfg)
    batch["policy_logits"] = batch["policy_logits"] * 3.0
    batch["baseline"] = torch.full_like(batch["baseline"], 5.0)
    taken = []
    original = learner._steps_inputs
    learner._steps_inputs = lambda *args: taken.append(original(*args)) or taken[-1]
    return learner.update(batch, ()), taken[0]


def test_learner_anchor_takes_the_clips_against_the_passs_start_and_weights_the_actors_lag():
    """vtrace.ppo_anchor=learner: at a pass's first step the learner is its own anchor, so no ratio
    is clipped and the value clip holds nothing back; the behaviour's lag is a clipped weight."""
    by_behaviour, _ = anchored_update("behaviour")
    by_learner, inputs = anchored_update("learner")
    assert by_behaviour["ppo_clip_fraction"] > 0.3 and by_learner["ppo_clip_fraction"] == 0.0
    torch.testing.assert_close(inputs.anchor_log_probs, inputs.log_probs.detach())
    torch.testing.assert_close(inputs.anchor_values, inputs.outputs["baseline"].detach())
    weights = torch.exp(inputs.log_probs - inputs.behaviour_log_probs).detach().clamp(max=1.0)
    torch.testing.assert_close(inputs.anchor_weights, weights)
    assert 0 < weights.min() < 1 and weights.max() == 1.0  # the lag weighs some steps down, none up
    # Ratios of 1: the surrogate is the weighted advantages, the value loss the plain squared error.
    assert by_learner["pg_loss"] == pytest.approx(-(inputs.advantages * weights).sum().item(), rel=1e-5)
    plain = 0.5 * ((inputs.targets.vs - inputs.outputs["baseline"]) ** 2).sum().item()
    assert by_learner["baseline_loss"] == pytest.approx(0.5 * plain, rel=1e-5)  # times baseline_cost
    assert by_behaviour["baseline_loss"] > 2 * by_learner["baseline_loss"]  # clipped towards the far 5.0


def test_learner_anchor_needs_ppos_clip_and_minibatches_of_steps():
    cfg = steps_cfg()
    cfg.vtrace.ppo_anchor = "learner"
    with pytest.raises(ConfigError, match="vtrace.ppo_anchor=learner needs vtrace.ppo_clip"):
        settings.check(cfg)
    cfg.vtrace.ppo_clip, cfg.optim.minibatch_unit = 0.2, "unrolls"
    with pytest.raises(ConfigError, match="optim.minibatch_unit=steps"):
        settings.check(cfg)
    cfg.optim.minibatch_unit = "steps"
    settings.check(cfg)
