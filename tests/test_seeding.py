"""`seed` decides the initial weights and, with one actor, one env and one learner thread, the
first update exactly."""

from __future__ import annotations

import pytest

from helpers import TINY, rows, run_clis_together

# One env on one actor, one learner thread with one intra-op thread: nothing left to chance.
SERIAL = [
    *TINY,
    "backend.num_actors=1",
    "backend.envs_per_actor=1",
    "backend.learner_torch_threads=1",
    "total_steps=64",
]
FIRST_UPDATE = ("total_loss", "pg_loss", "baseline_loss", "entropy_loss", "grad_norm", "episode_returns")


def first_update(run_dir) -> dict:
    return {key: rows(run_dir)[0][key] for key in FIRST_UPDATE}


@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_same_seed_gives_an_identical_first_update(tmp_path, backend):
    extra = ["backend.num_learner_threads=1"] if backend == "mono" else []
    runs = [tmp_path / name for name in ("a", "b", "other_seed")]
    # Three separate runs, started together: each decides its first update alone.
    run_clis_together(
        *[(run_dir, *SERIAL, f"backend={backend}", f"seed={seed}", *extra) for run_dir, seed in zip(runs, (7, 7, 8))]
    )
    same, also_same, other = (first_update(run_dir) for run_dir in runs)
    assert same == also_same
    assert same["total_loss"] != other["total_loss"]  # the seed matters at all


def test_seed_decides_the_initial_weights(tmp_path):
    import torch

    from torchbeast_hydra.env.spaces import probe_env
    from torchbeast_hydra.run.training_run import TrainingRun

    from helpers import compose_config

    cfg = compose_config([*TINY, "seed=3"])
    spec = probe_env(cfg.env)
    weights = []
    for name in ("a", "b"):
        torch.rand(5)  # whatever ran before must not matter
        (tmp_path / name).mkdir()
        run = TrainingRun(cfg, tmp_path / name, spec)
        weights.append([p.detach().clone() for p in run.learner.model.parameters()])
        run.close()
    assert all(torch.equal(a, b) for a, b in zip(*weights))
