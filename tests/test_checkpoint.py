import random
from pathlib import Path

import numpy as np
import pytest
import torch

from torchbeast_hydra.run import checkpoint
from torchbeast_hydra.run.checkpoint import CheckpointError


def state(step):
    return dict(
        learner=dict(model={"w": torch.full((3,), float(step))}),
        step=step,
        stats=dict(episodes=step),
        rng=checkpoint.rng_state(),
        config={},
    )


def test_round_trip_and_previous_kept(tmp_path):
    path = checkpoint.path_in(tmp_path)
    checkpoint.save(path, state(1))
    checkpoint.save(path, state(2))
    assert checkpoint.load(path)["step"] == 2
    assert checkpoint.load(tmp_path / checkpoint.PREVIOUS)["step"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files


def test_rng_state_round_trip():
    saved = checkpoint.rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint.set_rng_state(saved)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_checkpoint_names_the_file_and_the_fallback(tmp_path, damage):
    path = checkpoint.path_in(tmp_path)
    checkpoint.save(path, state(1))
    checkpoint.save(path, state(2))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00garbage" * 100, "empty": b""}[damage])
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(path)
    assert str(path) in str(error.value) and checkpoint.PREVIOUS in str(error.value)
    assert checkpoint.load(tmp_path / checkpoint.PREVIOUS)["step"] == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.load(checkpoint.path_in(tmp_path))


def test_checkpoint_never_runs_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = checkpoint.path_in(tmp_path)
    torch.save(dict(format_version=checkpoint.FORMAT_VERSION, evil=Evil()), path)
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load(path)


def test_failed_write_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    path = checkpoint.path_in(tmp_path)
    checkpoint.save(path, state(1))

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        checkpoint.save(path, state(2))
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.FILENAME]


# Saved by the release before the packages moved (commit 9197ace: a CartPole run of 1,280 steps),
# whose model target is the old path torchbeast_hydra.models.MLPBody.
BEFORE_THE_MOVE = Path(__file__).parent / "data" / "checkpoint-9197ace-cartpole.pt"


def test_a_checkpoint_saved_before_the_move_loads_and_acts():
    from omegaconf import OmegaConf

    from torchbeast_hydra.agent.models import make_model, saved_model_config
    from torchbeast_hydra.env.settings import EnvConfig
    from torchbeast_hydra.env.vector import Environments
    from torchbeast_hydra.evaluation.evaluate import Rules, play

    state = checkpoint.load(BEFORE_THE_MOVE)
    assert state["config"]["model"]["_target_"] == "torchbeast_hydra.models.MLPBody"
    env_cfg = OmegaConf.merge(OmegaConf.structured(EnvConfig), state["config"]["env"])
    envs = Environments(env_cfg, 1, seed=3)
    model = make_model(saved_model_config(state["config"]["model"]), envs.spec)
    model.load_state_dict(state["learner"]["model"])  # every saved tensor fits, by name and shape
    assert type(model.body).__module__ == "torchbeast_hydra.agent.models"
    returns, lengths = play(model.eval(), envs, Rules(episodes=2, max_episode_steps=500))
    envs.close()
    assert len(returns) == 2 and all(length >= 8 for length in lengths)


def test_a_trained_policy_loads_from_a_run_dir_and_acts(tmp_path):
    from torchbeast_hydra.evaluation.policy import load_policy

    (tmp_path / "checkpoint.pt").write_bytes(BEFORE_THE_MOVE.read_bytes())
    policy = load_policy(tmp_path)
    assert policy.step == 1280 and policy.env_cfg.id == "CartPole-v1"
    returns = policy.play(episodes=2, seed=5)
    assert len(returns) == 2 and all(r >= 8 for r in returns)
    envs = policy.make_envs(num_envs=3, seed=0)
    out, state = envs.initial(), policy.initial_state(3)
    actions, state = policy.act(out, state)
    assert actions.shape == (3,) and set(actions.tolist()) <= {0, 1}
    envs.step(actions)
    envs.close()
