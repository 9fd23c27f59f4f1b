"""NetHack, MiniHack and MiniGrid as env options: each brings a model that fits, and trains
briefly with its defaults, the three over both backends (the extras `.[nethack]`, `.[minihack]`,
`.[minigrid]`)."""

import pytest

from torchbeast_hydra.env.make import _unknown_env_error, import_modules
from torchbeast_hydra.env.spaces import probe_env
from torchbeast_hydra.errors import ConfigError

from helpers import REPO, SMALL, compose_config, rows, run_cli

FAMILIES = {  # env option -> (the model it brings, its default id, the observation's leaves)
    "nethack": ("NetHackBody", "NetHackScore-v0", ("obs/blstats", "obs/glyphs")),
    "minihack": ("NetHackBody", "MiniHack-Room-15x15-v0", ("obs/blstats", "obs/glyphs")),
    "minigrid": ("MultiBody", "MiniGrid-DoorKey-6x6-v0", ("obs/direction", "obs/image")),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_brings_its_model_and_observation_leaves(family):
    body, env_id, keys = FAMILIES[family]
    cfg = compose_config([f"env={family}"])
    assert cfg.env.id == env_id and cfg.model._target_.endswith(body)
    assert probe_env(cfg.env).leaf_keys == keys
    assert compose_config([f"env={family}", "model=multi"]).model._target_.endswith("MultiBody")  # yours wins


def test_minigrid_reads_its_view_as_codes():
    assert compose_config(["env=minigrid"]).model.code_images == ["obs/image"]  # model=minigrid


def test_a_missing_family_package_names_the_pip_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "minigrid", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'pip install "torchbeast_hydra\[minigrid\]"'):
        import_modules(["minigrid"])


# One actor, a few updates.
BRIEF = ["total_steps=640", *SMALL, "backend.num_actors=1"]


# Each family once, the three spread over both backends: NetHack and MiniHack are the same NLE envs
# and model (one on each backend), and MultiBody's structured observations train on both backends
# in tests/test_observations.py.
@pytest.mark.slow
@pytest.mark.parametrize("family, backend", [("nethack", "mono"), ("minihack", "poly"), ("minigrid", "poly")])
def test_each_family_trains_briefly(tmp_path, family, backend):
    run_dir = tmp_path / f"{family}-{backend}"
    # A small NetHack net keeps the run a few seconds; the defaults are the baseline's full size.
    model = ["model.output_size=64", "model.conv_channels=[4,4]"] if FAMILIES[family][0] == "NetHackBody" else []
    run_cli(run_dir, f"env={family}", f"backend={backend}", *model, *BRIEF)
    assert int(rows(run_dir)[-1]["step"]) >= 640


def test_the_family_table_is_what_the_options_the_extras_and_the_hints_use():
    """One table (env/families.py): each family's env option brings the table's model and default id,
    its extra exists under the option's name, and an id of the family typed without it names it."""
    import tomllib

    from torchbeast_hydra.env import families

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for family in families.FAMILIES:
        cfg = compose_config([f"env={family.option}"])
        assert cfg.env.id == family.default_id and cfg.env.imports == [family.module]
        model = compose_config([f"model={family.model}"]).model._target_
        assert cfg.model._target_ == model, f"env={family.option} should bring model={family.model}"
        assert family.option in extras
        # typed on the default env=pong (whether or not another test registered the family's ids here)
        assert f"env={family.option}" in str(_unknown_env_error(family.default_id, KeyError("not registered")))


@pytest.mark.slow
def test_experiment_minihack_trains_briefly_on_its_crop_alone(tmp_path):
    """The MiniHack preset (egocentric crop, no map convs; APPO's epochs and minibatches) end to end."""
    run_dir = tmp_path / "minihack-preset"
    small_model = ["model.output_size=64", "model.conv_channels=[4,4]", "optim.minibatches=2"]
    run_cli(run_dir, "experiment=minihack", *small_model, *BRIEF, "eval.final=false")
    assert int(rows(run_dir)[-1]["step"]) >= 640
    saved = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "full_map: false" in saved and "crop_size: 29" in saved and "epochs: 2" in saved


def test_nethack_games_follow_the_reset_seed():
    """NLE seeds only gymnasium's generator on reset(seed=...); the games must follow it too, so that
    a run, and its evaluations on seeds of their own, play the same games again."""
    pytest.importorskip("minihack")
    from torchbeast_hydra.env.make import make_env

    def first_maps(seed, games=3):
        env = make_env(compose_config(["env=minihack", "env.id=MiniHack-Room-Monster-15x15-v0"]).env)
        maps = [env.reset(seed=seed)[0]["glyphs"].tobytes()]
        maps += [env.reset()[0]["glyphs"].tobytes() for _ in range(games - 1)]
        env.close()
        return maps

    again = first_maps(5)
    assert first_maps(5) == again and len(set(again)) == 3  # the same games, each a new one
    assert first_maps(6)[0] != again[0]
