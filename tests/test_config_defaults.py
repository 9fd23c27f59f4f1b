"""Every default has one home, the typed schema; each YAML option holds only what it changes.

And each env option brings a model that fits it (env=cartpole -> the MLP).
"""

import math
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR

from helpers import TINY, compose_config, leaves, rows, run_cli

CONF = Path(CONFIG_DIR)
# Hydra's own groups extend Hydra's schemas; presets and ablations (global overrides of a preset)
# are checked against the composed config below; pbt's options (global: they set the sweeper too)
# in tests/test_pbt.py; tasks (a task's own settings in a suite, global) in tests/test_tasks.py.
OPTION_FILES = sorted(
    p.relative_to(CONF).as_posix()
    for p in CONF.rglob("*.yaml")
    if p.relative_to(CONF).parts[0] not in ("hydra", "experiment", "ablation", "pbt", "task")
)
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def lookup(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree[key]
    return tree


def plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, enum_to_str=True)


def schema_of(relative_path: str, defaults: list):
    """The typed schema an option file extends: the base_* its defaults list names, in its group."""
    bases = [d for d in defaults if isinstance(d, str) and d.startswith("base_")]
    assert len(bases) == 1, f"{relative_path} must extend one typed schema (base_...) in its defaults list"
    group = str(Path(relative_path).parent)
    path = f"{bases[0]}.yaml" if group == "." else f"{group}/{bases[0]}.yaml"
    return OmegaConf.structured(ConfigStore.instance().load(path).node)


def repeated_defaults(relative_path: str, conf: Path = CONF) -> list[str]:
    """The keys of a conf/ option file whose value is its schema's default."""
    content = OmegaConf.to_container(OmegaConf.load(conf / relative_path))
    schema = schema_of(relative_path, content.pop("defaults", []))
    content.pop("hydra", None)  # config.yaml's Hydra settings are Hydra's, not the schema's
    merged, default = plain(OmegaConf.merge(schema, content)), plain(schema)
    return [key for key, _ in leaves(content) if lookup(merged, key) == lookup(default, key)]


@pytest.mark.parametrize("relative_path", OPTION_FILES)
def test_option_files_hold_only_what_differs_from_their_schema(relative_path):
    assert repeated_defaults(relative_path) == [], (
        f"conf/{relative_path} repeats its schema's defaults (the settings modules): drop these keys"
    )


def test_a_repeated_default_is_found(tmp_path):
    # the check above can fail: a copy of conf/ with defaults written back into three files
    conf = tmp_path / "conf"
    for relative_path in ("config.yaml", "vtrace/default.yaml", "backend/mono.yaml"):
        (conf / relative_path).parent.mkdir(parents=True, exist_ok=True)
        (conf / relative_path).write_text((CONF / relative_path).read_text())
    with open(conf / "config.yaml", "a") as f:
        f.write("batch_size: 8\nseed: 2\n")
    with open(conf / "vtrace/default.yaml", "a") as f:
        f.write("reward_clipping: abs_one\nentropy_cost: 0.02\n")
    with open(conf / "backend/mono.yaml", "a") as f:
        f.write("num_buffers: null\n")
    assert repeated_defaults("config.yaml", conf) == ["batch_size"]
    assert repeated_defaults("vtrace/default.yaml", conf) == ["reward_clipping"]
    assert repeated_defaults("backend/mono.yaml", conf) == ["num_buffers"]


def preset_repeats(name: str) -> list[str]:
    """The keys a preset sets to the value its group choices alone would compose."""
    content = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml"))
    content.pop("hydra", None)  # Hydra's own settings (a suite's sweep): not the job's config
    defaults = content.pop("defaults", [])
    choices = [
        f"{key.removeprefix('override /')}={value}"
        for item in defaults
        if isinstance(item, dict)
        for key, value in item.items()
    ]
    # A preset built on another (suites on experiment=control): the other's values are its defaults.
    choices += [f"experiment={item}" for item in defaults if isinstance(item, str) and item != "_self_"]
    with_preset, without = plain(compose_config([f"experiment={name}"])), plain(compose_config(choices))
    return [key for key, _ in leaves(content) if lookup(with_preset, key) == lookup(without, key)]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_set_only_what_differs_from_the_defaults(name):
    assert preset_repeats(name) == [], f"conf/experiment/{name}.yaml repeats the composed defaults"


@pytest.mark.parametrize(
    "overrides, body",
    [
        (["env=cartpole"], "MLPBody"),
        (["env=cartpole", "model=resnet"], "ResNetBody"),  # the command line wins over the env's choice
        (["model=resnet", "env=cartpole"], "ResNetBody"),
        (["experiment=cartpole"], "MLPBody"),
        (["experiment=cartpole", "model=atari_net"], "AtariNetBody"),
        (["env=pong"], "AtariNetBody"),
        (["env=breakout"], "AtariNetBody"),
    ],
)
def test_each_env_option_brings_a_model_that_fits(overrides, body):
    cfg = compose_config(overrides)
    assert cfg.model._target_ == f"torchbeast_hydra.agent.models.{body}"


@pytest.mark.slow
def test_cartpole_trains_with_env_cartpole_alone(tmp_path):
    overrides = [o for o in TINY if not o.startswith("experiment=")]
    run_cli(tmp_path / "run", "env=cartpole", *overrides, "backend.num_actors=1")
    config = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert config.env.id == "CartPole-v1" and config.model._target_.endswith("MLPBody")
    assert (tmp_path / "run" / "logs.csv").exists()


ABLATIONS = sorted(path.stem for path in (CONF / "ablation").glob("*.yaml"))


@pytest.mark.parametrize("name", ABLATIONS)
def test_each_ablation_changes_only_its_own_lever_of_the_control_preset(name):
    preset = plain(compose_config(["experiment=control"]))
    ablated = plain(compose_config(["experiment=control", f"ablation={name}"]))
    changed = {key for key, value in leaves(ablated) if lookup(preset, key) != value}
    content = OmegaConf.to_container(OmegaConf.load(CONF / "ablation" / f"{name}.yaml")) or {}
    assert changed == {key for key, _ in leaves(content)}
    assert (changed == set()) == (name == "none")  # every other ablation turns something off


def test_the_levers_suite_runs_every_ablation():
    suite = OmegaConf.load(CONF / "experiment" / "suite_mujoco_levers.yaml")
    assert sorted(str(suite.hydra.sweeper.params["ablation"]).split(",")) == ABLATIONS


def test_the_atari_suite_composes_the_env_protocol_of_the_references_it_is_set_beside():
    """experiment=suite_atari runs on the env settings that Dopamine's figures (baselines.yaml) need,
    on each of its games, so that its runs compare with them."""
    from torchbeast_hydra.analysis import baselines, measures

    known = baselines.load_baselines()
    for env in ("breakout", "space_invaders", "beam_rider"):
        cfg = plain(compose_config(["experiment=suite_atari", f"env={env}"]))
        flat = {f"env.{k}": v for k, v in cfg["env"].items()}
        dopamine = [r for r in known[cfg["env"]["id"]].references if r["name"].startswith("Dopamine")]
        assert dopamine and all(measures.other_settings(r, [flat]) is None for r in dopamine), env
        assert cfg["total_steps"] == dopamine[0]["steps"]  # its budget: 10M frames
        assert (cfg["env"]["noop_max"], cfg["env"]["fire_reset"], cfg["env"]["episodic_life"]) == (0, False, False)


@pytest.mark.slow
def test_the_control_preset_trains_with_its_ppo_levers(tmp_path):
    """experiment=control, levers and all, learns a few updates on a Box task (Pendulum: no MuJoCo needed)."""
    run_cli(
        tmp_path / "run",
        "experiment=control",
        "env.id=Pendulum-v1",
        "total_steps=1024",
        "batch_size=8",  # 256 steps a batch, 4 updates: the levers' code paths, not their learning
        "optim.epochs=2",  # each batch learned twice, in 4 minibatches of steps (the preset: 10 x 32)
        "optim.minibatches=4",
        "backend.num_actors=1",
        "backend.envs_per_actor=2",
        "eval.interval_steps=0",
        "logger.wandb.mode=disabled",
    )
    config = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert config.optim.minibatch_unit == "steps" and config.optim.targets_once and config.vtrace.normalize_rewards
    logged = rows(tmp_path / "run")
    assert int(logged[-1]["step"]) >= 1024
    stds = [float(row["return_std"]) for row in logged if row.get("return_std")]
    assert stds and all(math.isfinite(std) and std > 0 for std in stds)  # the rewards' running spread, learned
    assert all(math.isfinite(float(row["total_loss"])) for row in logged if row.get("total_loss"))
