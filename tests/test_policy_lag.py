"""Policy lag and the behaviour/learner divergence: the figures on hand-built batches, stale rollouts
masked out, the weights' version as published, mono's synchronous grants, and short runs where
backend.synchronous gives lag 0 on each backend."""

from __future__ import annotations

import math
import threading
from multiprocessing import Pipe

import numpy as np
import pytest
import torch
from test_learner import learner_batch, learner_cfg, make_learner, tiny_batch, tiny_outputs, vtrace_cfg

from torchbeast_hydra.backends.mono.backend import BufferPool, _encode_report
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning.learner import loss_inputs
from torchbeast_hydra.learning.policy_lag import (
    BehaviourVersions,
    divergence,
    lag_figures,
    stale_rollouts,
    without_rollouts,
)
from torchbeast_hydra.run.publish import WeightPublisher

from helpers import TINY, compose_config, rows, run_cli

# Rows 0..3 of three rollouts' policy_version (row 0 is the previous unroll's last: not learned from).
VERSIONS = [[0, 0, 0], [5, 3, 7], [6, 3, 7], [6, 4, 9]]
MASK = [[True, True, True], [True, True, True], [True, True, False], [True, True, False]]  # column 2: 1 real step


def hand_batch() -> dict:
    return dict(policy_version=torch.tensor(VERSIONS), mask=torch.tensor(MASK))


def test_lag_figures_count_real_steps_only():
    versions = BehaviourVersions.of(hand_batch())
    # Real steps' versions: 5, 6, 6 | 3, 3, 4 | 7 (9 is padding); learner at 10 updates.
    assert versions.steps == 7 and versions.total == 34
    assert versions.oldest.tolist() == [5, 3, 7]
    lag = lag_figures(versions, learner_updates=10)
    assert lag["policy_lag_mean"] == pytest.approx(10 - 34 / 7, abs=1e-3)
    assert lag["policy_lag_max"] == 7  # the 3 of column 1


def test_stale_rollouts_are_those_with_a_step_older_than_the_limit():
    versions = BehaviourVersions.of(hand_batch())
    assert stale_rollouts(versions, 10, max_lag=None).tolist() == []
    assert stale_rollouts(versions, 10, max_lag=4).tolist() == [0, 1]  # lags 5 and 7; column 2's is 3
    assert stale_rollouts(versions, 10, max_lag=6).tolist() == [1]
    assert stale_rollouts(versions, 7, max_lag=0).tolist() == [0, 1]  # column 2 acted by version 7: fresh
    batch = hand_batch()
    kept = without_rollouts(batch, torch.tensor([1]))
    assert not kept["mask"][:, 1].any() and kept["mask"][:, 0].all()
    assert batch["mask"][:, 1].all()  # the batch's own mask (maybe a shared buffer's) is untouched


def test_a_rollout_of_padding_only_is_never_stale():
    batch = hand_batch()
    batch["mask"][1:, 2] = False
    versions = BehaviourVersions.of(batch)
    assert stale_rollouts(versions, 100, max_lag=0).tolist() == [0, 1]
    assert lag_figures(BehaviourVersions.of({k: v[:, 2:] for k, v in batch.items()}), 100)["policy_lag_max"] == ""


def test_divergence_by_hand():
    """Behaviour uniform over 2 actions; the learner at logits (log 3, 0): pi = (0.75, 0.25)."""
    batch = tiny_batch()
    batch["policy_logits"] = torch.zeros(3, 1, 2)
    batch["action"] = torch.tensor([[0], [0], [1]])  # steps 0 and 1 take actions 0 and 1
    outputs = tiny_outputs()
    outputs["policy_logits"] = torch.tensor([[math.log(3), 0.0]] * 3).unsqueeze(1)
    inputs = loss_inputs(vtrace_cfg(ppo_clip=0.2), batch, outputs)
    figures = {key: float(value) for key, value in divergence(inputs).items()}
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(behaviour || learner), per step
    assert figures["policy_kl"] == pytest.approx(kl, rel=1e-5)
    assert figures["rho_clip_fraction"] == pytest.approx(0.5)  # ratio 1.5 clipped by rho_bar = 1; 0.5 not
    assert figures["ppo_clip_fraction"] == pytest.approx(1.0)  # 1.5 and 0.5 both outside [0.8, 1.2]

    batch["mask"][2] = False  # the second step is padding: only the first counts
    figures = divergence(loss_inputs(vtrace_cfg(ppo_clip=0.6), batch, outputs))
    assert float(figures["policy_kl"]) == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25))
    assert float(figures["rho_clip_fraction"]) == 1.0 and float(figures["ppo_clip_fraction"]) == 0.0


def test_on_policy_data_has_no_divergence_and_ppo_figures_only_with_ppo_clip():
    batch = tiny_batch()
    outputs = tiny_outputs()
    # Row t+1 holds the behaviour's parameters for the step the learner's row t scores.
    batch["policy_logits"][1:] = outputs["policy_logits"].detach()[:-1]
    figures = divergence(loss_inputs(vtrace_cfg(), batch, outputs))
    assert set(figures) == {"policy_kl", "rho_clip_fraction"}
    assert float(figures["policy_kl"]) == pytest.approx(0.0, abs=1e-7) and float(figures["rho_clip_fraction"]) == 0


def test_the_learner_reports_the_divergence_and_counts_its_updates():
    cfg = learner_cfg()
    learner = make_learner(cfg)
    assert learner.updates == 0
    stats = learner.update(learner_batch(cfg), learner.model.initial_state(cfg.batch_size))
    assert learner.updates == 1
    assert stats["policy_kl"] >= 0 and 0 <= stats["rho_clip_fraction"] <= 1 and "ppo_clip_fraction" not in stats


def test_the_publisher_writes_the_learner_updates_the_weights_reflect_and_wakes_waiters():
    learner_model, policy = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    updates = [0]
    publisher = WeightPublisher(
        learner_model, policy, threading.Lock(), threading.Lock(), interval=2, updates=lambda: updates[0]
    )
    publisher.publish_now()
    assert int(publisher.version) == 0
    updates[0] = 1
    publisher.after_update()  # interval 2: not yet
    assert int(publisher.version) == 0
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (publisher.wait_for_newer(1, threading.Event()), woke.set()))
    waiter.start()
    updates[0] = 2
    publisher.after_update()
    waiter.join(timeout=5)
    assert int(publisher.version) == 2 and woke.is_set()
    stop = threading.Event()
    stop.set()
    publisher.wait_for_newer(2, stop)  # returns at once once stopping


def test_synchronous_pool_grants_an_actor_again_only_with_newer_weights():
    version = torch.zeros((), dtype=torch.int64)
    pool = BufferPool(count=8, per_actor=2, unroll_length=4, version=version)
    learner_end, actor_end = Pipe()
    pool.add_actor(0, learner_end)
    grant = actor_end.recv_bytes()
    actor_end.send_bytes(_report(grant))
    pool.receive(timeout=1.0)
    assert not actor_end.poll(0.2)  # its unroll used version 0: it waits for newer weights
    version.fill_(1)
    pool.regrant()
    assert actor_end.poll(1.0)
    # Without a version (asynchronous), the next grant follows the report at once.
    free = BufferPool(count=8, per_actor=2, unroll_length=4)
    learner_end, actor_end = Pipe()
    free.add_actor(0, learner_end)
    actor_end.send_bytes(_report(actor_end.recv_bytes()))
    free.receive(timeout=1.0)
    assert actor_end.poll(1.0)


def _report(grant: bytes) -> bytes:
    """An actor's report that it filled the buffers of this grant."""
    return _encode_report(np.frombuffer(grant, np.int32).tolist(), 0.0, 0.0, 0)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["backend.synchronous=true", "backend.publish_interval=2"], "backend.publish_interval=1"),
        (["backend.synchronous=true", "batch_size=8"], "at least batch_size=8 envs"),
        (["backend=poly", "backend.synchronous=true"], "backend.cut_at_reset=false"),
        (["backend.max_policy_lag=-1"], "backend.max_policy_lag must be >= 0"),
    ],
)
def test_synchronous_and_max_lag_settings_are_checked(overrides, says):
    from torchbeast_hydra.config import validate

    cfg = compose_config([*TINY, *overrides])
    with pytest.raises(ConfigError, match=says):
        validate(cfg)


def lag_rows(run_dir) -> list:
    return [row for row in rows(run_dir) if row.get("policy_lag_max") not in ("", None)]


@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_synchronous_runs_learn_only_from_the_current_weights(tmp_path, backend):
    extra = ["backend=poly", "backend.cut_at_reset=false"] if backend == "poly" else []
    run_dir = tmp_path / backend
    run_cli(run_dir, *TINY, *extra, "backend.synchronous=true")
    logged = lag_rows(run_dir)
    assert len(logged) >= 10 and int(logged[-1]["step"]) >= 2560
    assert all(int(row["policy_lag_max"]) == 0 for row in logged)
    # At least batch_size envs acting, every batch is whole and fresh: nothing was dropped.
    assert sum(int(row["dropped_stale_rollouts"] or 0) for row in logged) == 0
    assert all(float(row["policy_kl"]) < 1e-4 for row in logged)  # the same weights acted and learn


def test_a_max_policy_lag_drops_older_rollouts_and_counts_them(tmp_path):
    run_dir = tmp_path / "run"
    # Two learner threads and eight envs for batches of four: rollouts wait while others are learned from.
    run_cli(run_dir, *TINY, "backend.envs_per_actor=4", "backend.max_policy_lag=0")
    logged = lag_rows(run_dir)
    assert int(logged[-1]["step"]) >= 2560  # dropped rollouts' steps count: they were played
    assert sum(int(row["dropped_stale_rollouts"]) for row in logged) > 0
    assert max(int(row["policy_lag_max"]) for row in logged) >= 1  # the lag before dropping, as measured
